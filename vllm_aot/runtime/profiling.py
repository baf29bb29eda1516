"""Named ranges in a torch profiler trace, paid for only while a profiler records.

Whoever starts a profiler sets `Spans.is_enabled` (the vLLM worker does it from `/start_profile`);
until then a span is a shared no-op context and `wrap` returns the callable itself, so a step
checks one flag per span and nothing per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

from torch.profiler import record_function

F = TypeVar("F", bound=Callable)

_NO_SPAN = nullcontext()


class Spans:
    def __init__(self) -> None:
        self.is_enabled = False

    def __call__(self, name: str) -> AbstractContextManager:
        """A range named `name` around the block (a no-op while disabled)."""
        return record_function(name) if self.is_enabled else _NO_SPAN

    def wrap(self, fn: F, name: str) -> F:
        """`fn`, each call a range named `name` while enabled; `fn` itself otherwise.

        Decided once per call of `wrap`: callers wrap per step, then call per layer.
        """
        if not self.is_enabled:
            return fn

        def named(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return named  # type: ignore[return-value]
