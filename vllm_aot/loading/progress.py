"""One line a person can read while programs compile: done / total, elapsed, estimate.

On a terminal the line is redrawn in place; in a log (a server's start-up, CI) it is written at
most once every `log_every` seconds and once at the end, so a 40-program compile adds a handful
of lines, not one per program.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import TextIO

from vllm_aot.runtime.programs import ProgramKey


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class CompileProgress:
    """Counts compiled programs and reports them as one line (`update()` once per program)."""

    def __init__(
        self,
        total: int,
        *,
        write: Callable[[str], None] | None = None,
        stream: TextIO | None = None,
        log_every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        groups: Mapping[int, int] | None = None,
    ) -> None:
        """Report through `write(line)` (a logger) or redraw on `stream` (default stderr);
        `groups` (layer group -> its layer programs to compile) adds each group's count."""
        self.total = total
        self.done = 0
        self.groups = dict(groups or {})
        self.groups_done: Counter[int] = Counter()
        self._write = write
        self._stream = stream if stream is not None else sys.stderr
        self._is_tty = write is None and self._stream.isatty()
        self._log_every = log_every
        self._clock = clock
        self._start = clock()
        self._last_written = self._start

    def line(self) -> str:
        elapsed = self._clock() - self._start
        text = f"compiling programs: {self.done}/{self.total} done, {_duration(elapsed)} elapsed"
        if 0 < self.done < self.total:
            left = elapsed / self.done * (self.total - self.done)
            text += f", about {_duration(left)} left"
        if len(self.groups) > 1:
            counts = (f"{g}: {self.groups_done[g]}/{n}" for g, n in sorted(self.groups.items()))
            text += f" (layer programs by group {', '.join(counts)})"
        return text

    def update(self, group: int | None = None) -> None:
        """One more program compiled; `group`: the layer group of a layer program."""
        self.done += 1
        if group is not None:
            self.groups_done[group] += 1
        now = self._clock()
        is_last = self.done == self.total
        if self._is_tty:
            self._stream.write(f"\r{self.line()}" + ("\n" if is_last else ""))
            self._stream.flush()
        elif is_last or now - self._last_written >= self._log_every:
            self._last_written = now
            self._emit(self.line())

    def _emit(self, text: str) -> None:
        if self._write is not None:
            self._write(text)
        else:
            print(text, file=self._stream, flush=True)


def seconds_by_group(seconds: Mapping[str, float], keys: Iterable[ProgramKey]) -> str:
    """Compile seconds of the programs named in `seconds` per program group, e.g. "layer group
    0: 21 programs, 300 s; layer group 1: 21 programs, 290 s; head: 12 programs, 150 s"."""
    group_of = {k.name: f"layer group {k.group}" if k.is_layer else "head" for k in keys}
    totals: dict[str, list[float]] = {}
    for name, secs in seconds.items():
        totals.setdefault(group_of.get(name, "other"), []).append(secs)
    return "; ".join(
        f"{group}: {len(v)} programs, {sum(v):.0f} s" for group, v in sorted(totals.items())
    )
