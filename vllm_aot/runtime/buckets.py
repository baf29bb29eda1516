"""Bucket sets and bucket choice: pure functions, no tensors."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... up to hi, always ending with hi itself."""
    assert 0 < lo <= hi, f"bad bucket range {lo}..{hi}"
    values = []
    value = lo
    while value < hi:
        values.append(value)
        value *= 2
    values.append(hi)
    return tuple(values)


def fitting_bucket(buckets: Sequence[int], needed: int) -> int | None:
    """The smallest bucket >= needed; None if none is that large."""
    return min((b for b in buckets if b >= needed), default=None)


def pick_bucket(buckets: Sequence[int], needed: int) -> int:
    """The smallest bucket >= needed. Raises ValueError naming the largest bucket."""
    bucket = fitting_bucket(buckets, needed)
    if bucket is None:
        raise ValueError(f"{needed} exceeds the largest bucket ({max(buckets)})")
    return bucket


def validate_buckets(
    name: str, buckets: Sequence[int], maximum: int, minimum: int = 1
) -> tuple[int, ...]:
    """Sorted, unique, at least `minimum`, and covering `maximum` (the largest must equal it)."""
    values = tuple(sorted(set(int(b) for b in buckets)))
    if not values or values[0] < minimum:
        kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {list(buckets)}")
    if values[-1] != maximum:
        raise ValueError(f"the largest of {name} must be {maximum}, got {list(values)}")
    return values


@functools.lru_cache(maxsize=4096)
def bucket_split(needed: int, buckets: tuple[int, ...], call_cost: int) -> tuple[int, ...]:
    """Sizes of the calls that cover `needed` tokens most cheaply when a call of bucket b costs
    b + call_cost: whole buckets, the last one padded; one call unless splitting costs strictly
    less (a 130-token prompt as 128 + 2 in a 32, not 130 in a 512). Pure: no tensors; worked
    out bottom up (any bucket size, any length) and remembered (every prefill step asks)."""
    assert needed > 0, "a call covers at least one token"
    larger_first = sorted(buckets, reverse=True)  # larger pieces first on equal cost
    cost = [0] * (needed + 1)  # cost[n]: the cheapest cover of n tokens
    first = [0] * (needed + 1)  # its first call's size
    calls = [0] * (needed + 1)  # and its number of calls
    for n in range(1, needed + 1):
        bucket = fitting_bucket(buckets, n)
        best = (math.inf, 0) if bucket is None else (bucket + call_cost, 1)
        first[n] = n
        for b in larger_first:
            option = (b + call_cost + cost[n - b], 1 + calls[n - b]) if b < n else None
            if option is not None and option < best:
                best, first[n] = option, b
        cost[n], calls[n] = best
    sizes, n = [], needed
    while n:
        sizes.append(first[n])
        n -= first[n]
    return tuple(sizes)
