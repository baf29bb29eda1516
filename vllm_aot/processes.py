"""Child-process plumbing shared by compile workers and serving replicas."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive `signum` when the thread that started it
    dies (Linux), so a killed parent leaves no child running. libc is loaded here, before the
    fork: the child only makes the system call."""
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signum)
