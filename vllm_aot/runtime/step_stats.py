"""What the buckets cost: real vs padded rows, tokens and context tokens per layer pass (pure).

`CompiledModel` records every layer pass (one run of a prefill or decode program over all layers):
a few integer adds and one bisect, no tensor reads. Per kind:

- rows: sequences vs the row bucket (prefill: chunks vs the head's row bucket; decode: rows vs
  the batch bucket);
- tokens: tokens vs the token bucket (prefill: packed tokens vs `T`; decode: one per row vs `B`);
- context tokens: cached tokens the real rows attend to vs what the program reads (prefill: the
  chunks' cached tokens vs `C`; decode: each row's position vs `B * C`, padded rows included);
- padding fraction: each pass's padded share of its token bucket, as a histogram.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

LAYER_KINDS = ("prefill", "decode", "verify", "encode")
# Upper bounds of the padding-fraction histogram's buckets (a fraction never exceeds 1).
PADDING_FRACTION_BOUNDS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Slots:
    """Real and padded slots of one bucketed quantity, summed over passes."""

    real: int = 0
    padding: int = 0

    def add(self, num_real: int, bucket: int) -> None:
        assert 0 <= num_real <= bucket, f"{num_real} real slots do not fit a bucket of {bucket}"
        self.real += num_real
        self.padding += bucket - num_real


@dataclass
class PaddingHistogram:
    """Passes per padding-fraction bucket (not cumulative) and the fractions' sum."""

    counts: list[int] = field(default_factory=lambda: [0] * len(PADDING_FRACTION_BOUNDS))
    total: float = 0.0

    def observe(self, fraction: float) -> None:
        self.counts[bisect_left(PADDING_FRACTION_BOUNDS, fraction)] += 1
        self.total += fraction


@dataclass
class KindStats:
    rows: Slots = field(default_factory=Slots)
    tokens: Slots = field(default_factory=Slots)
    context_tokens: Slots = field(default_factory=Slots)
    padding_fraction: PaddingHistogram = field(default_factory=PaddingHistogram)


class StepStats:
    """Counters of every layer pass since start-up, per kind (`prefill`, `decode`, `verify`,
    `encode`).

    `record` runs on the stepping thread; `to_dict` may run on another one (a metrics writer):
    it copies plain ints, so a snapshot taken mid-pass may lag that pass by a field or two.
    """

    def __init__(self) -> None:
        self.kinds = {kind: KindStats() for kind in LAYER_KINDS}

    def record(
        self,
        kind: str,
        *,
        num_rows: int,
        row_bucket: int,
        num_tokens: int,
        token_bucket: int,
        num_context_tokens: int,
        context_bucket: int,
    ) -> None:
        """One layer pass: real counts and the bucket sizes the program ran with."""
        stats = self.kinds[kind]
        stats.rows.add(num_rows, row_bucket)
        stats.tokens.add(num_tokens, token_bucket)
        stats.context_tokens.add(num_context_tokens, context_bucket)
        stats.padding_fraction.observe((token_bucket - num_tokens) / token_bucket)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy: {kind: {rows|tokens|context_tokens: {real, padding},
        padding_fraction: {bounds, counts, sum}}}."""
        return {
            kind: {
                "rows": vars(s.rows).copy(),
                "tokens": vars(s.tokens).copy(),
                "context_tokens": vars(s.context_tokens).copy(),
                "padding_fraction": {
                    "bounds": list(PADDING_FRACTION_BOUNDS),
                    "counts": list(s.padding_fraction.counts),
                    "sum": s.padding_fraction.total,
                },
            }
            for kind, s in self.kinds.items()
        }
