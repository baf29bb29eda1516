"""Bucket sets and bucket choice: pure functions, no tensors."""

from __future__ import annotations

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


def bucket_split(needed: int, buckets: Sequence[int], call_cost: int) -> tuple[int, ...]:
    """Sizes of the calls that cover `needed` tokens most cheaply when a call of bucket b costs
    b + call_cost: whole buckets, the last one padded; one call unless splitting costs strictly
    less (a 130-token prompt as 128 + 2 in a 32, not 130 in a 512). Pure: no tensors."""
    best: dict[int, tuple[int, tuple[int, ...]]] = {}

    def cover(n: int) -> tuple[int, tuple[int, ...]]:
        if n not in best:
            bucket = fitting_bucket(buckets, n)
            options = [] if bucket is None else [(bucket + call_cost, (n,))]
            for b in sorted(buckets, reverse=True):  # larger pieces first on equal cost
                if b < n:
                    cost, rest = cover(n - b)
                    options.append((b + call_cost + cost, (b, *rest)))
            best[n] = min(options, key=lambda option: (option[0], len(option[1])))
        return best[n]

    assert needed > 0, "a call covers at least one token"
    return cover(needed)[1]
