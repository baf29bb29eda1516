"""Child-process plumbing shared by compile workers and serving replicas: the parent-death
signal, and a free loopback port for a child server."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive `signum` when the thread that started it
    dies (Linux), so a killed parent leaves no child running. libc is loaded here, before the
    fork: the child only makes the system call."""
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signum)


def free_port() -> int:
    """A loopback port nothing listens on now (the caller's child binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
