"""Core lists (`0-3,8-11`) and their split into one group per data-parallel replica (pure)."""

from __future__ import annotations

import os


def parse_core_list(text: str) -> tuple[int, ...]:
    """`"0-3,8,10-11"` -> (0, 1, 2, 3, 8, 10, 11), sorted; refuses duplicates and bad ranges."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            low, high = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(
                f"bad core list {text!r}: {part!r} is not a core id or a range like 0-3"
            ) from None
        if low < 0 or high < low:
            raise ValueError(
                f"bad core list {text!r}: {part!r} is not a range low-high, low <= high"
            )
        cores.extend(range(low, high + 1))
    if not cores:
        raise ValueError(f"bad core list {text!r}: no cores")
    duplicates = sorted({c for c in cores if cores.count(c) > 1})
    if duplicates:
        raise ValueError(f"bad core list {text!r}: cores {duplicates} listed more than once")
    return tuple(sorted(cores))


def format_core_list(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8": the compact form `parse_core_list` reads back."""
    ranges: list[str] = []
    start = previous = None
    for core in sorted(cores):
        if previous is not None and core == previous + 1:
            previous = core
            continue
        if start is not None:
            ranges.append(f"{start}-{previous}" if previous != start else str(start))
        start = previous = core
    if start is not None:
        ranges.append(f"{start}-{previous}" if previous != start else str(start))
    return ",".join(ranges)


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, not the machine's core count)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def group_cores(
    cores: tuple[int, ...], *, data_parallel_size: int, tensor_parallel_size: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Split `cores` into `data_parallel_size` equal, contiguous groups, one per replica.

    Each replica needs at least `tensor_parallel_size` cores; too few cores raise ValueError
    before anything starts. Cores left over by an uneven split stay unused (every replica then
    runs the same number of threads, so the router's least-loaded choice compares like with like).
    """
    if data_parallel_size < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"data and tensor parallel sizes must be >= 1, got {data_parallel_size} and "
            f"{tensor_parallel_size}"
        )
    needed = data_parallel_size * tensor_parallel_size
    if len(cores) < needed:
        raise ValueError(
            f"{data_parallel_size} replica(s) x tensor parallel {tensor_parallel_size} need at "
            f"least {needed} cores; only {len(cores)} given ({format_core_list(cores)})"
        )
    size = len(cores) // data_parallel_size
    return tuple(tuple(cores[i * size : (i + 1) * size]) for i in range(data_parallel_size))
