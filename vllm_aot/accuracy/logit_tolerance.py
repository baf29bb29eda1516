"""Logits of ours against a reference, per position and top-k slice, under a tolerance map.

Comparison, per position and per top-k slice: the slice "top k" is the k tokens with the largest
*reference* logits at that position (`None` = the whole vocabulary). A slice passes at a position
when every token in it satisfies

    |ours - ref| <= atol + rtol * max|ref|      (max over the slice's tokens at that position)

and we report the ratio max|ours - ref| / (atol + rtol * max|ref|): at most 1 means within
tolerance, and its size says by how much a failing slice misses. The scale is the slice's largest
logit, not each logit's own size (the convention of torch-neuronx's logit validation, where the
default tolerances come from): logits are only defined up to a common shift, and measured against
|ref| itself every logit near zero would fail even between two exact fp32 implementations.

Three-way mode (for a served dtype below fp32, e.g. bfloat16): baseline = HF in fp32, expected =
HF in the served dtype, target = ours in the served dtype; ratios of target vs baseline and of
expected vs baseline are taken at every position of every prompt. A slice passes when

    worst target ratio <= 1
    or (mean target ratio <= 1.1 * mean expected ratio
        and worst target ratio <= 1.5 * worst expected ratio)

that is: within tolerance of fp32 outright, or no further from fp32 than HF's own implementation
in the same dtype, on average (10 % slack) and in the worst case (50 % slack). Reduced precision
alone is never held against us; an error of our own is, whether it is spread over every position
(the mean moves) or confined to a few (the worst case moves). The two statistics get different
slack because a worst case over a few hundred positions is itself noisy: with identical error
distributions (same mean and quantiles) the worst cases of two bf16 implementations differ by up
to ~20 % on SmolLM2, so comparing worst cases with 10 % slack would fail at random.

`parse_tolerances` reads overrides of the tolerance map from the command line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class Tolerance:
    """|ours - ref| <= atol + rtol * max|ref| for every token of a slice (see module docstring)."""

    atol: float
    rtol: float


# top k (None = every token) -> tolerance; tighter for the tokens that matter most.
DEFAULT_TOLERANCES: Mapping[int | None, Tolerance] = MappingProxyType(
    {
        5: Tolerance(1e-5, 0.011),
        50: Tolerance(1e-5, 0.02),
        1000: Tolerance(1e-5, 0.03),
        None: Tolerance(1e-5, 0.05),
    }
)

# An FP8 KV cache (`RuntimeConfig.kv_cache_dtype`): HF keeps no such cache, so ours also differs
# from it by the rounding of every cached key and value (e4m3: 3 mantissa bits, a relative step of
# up to 2^-4; e5m2: 2 bits, 2^-3), on top of the dtype's own error. Measured on SmolLM2-135M over
# the validate prompts (8 chat prompts + 32 teacher-forced tokens, scales 1.0, eager), the worst
# |ours - HF fp32| / max|ref| per slice (top 5, 50, 1000, all; mean over positions for top 5):
#   float32  + e4m3: 0.155, 0.269, 0.163, 0.111 (mean 0.009; argmax agrees at 98.8 %)
#   bfloat16 + e4m3: 0.114, 0.262, 0.136, 0.136 (mean 0.016; 97.6 %)
#   float32  + e5m2: 0.177, 0.392, 0.282, 0.273 (mean 0.016; 97.4 %)
#   bfloat16 + e5m2: 0.254, 0.328, 0.345, 0.337 (mean 0.024; 97.0 %)
# (bfloat16 alone: 0.069, 0.115, 0.136, 0.051; HF's own bfloat16 0.079, 0.089, 0.166, 0.058). A few
# positions where the top tokens nearly tie carry the worst case; each tolerance is about 1.5x the
# worst measured in either dtype, so an error of our own on top of the rounding still fails.
FP8_KV_TOLERANCES: Mapping[str, Mapping[int | None, Tolerance]] = MappingProxyType(
    {
        "fp8_e4m3": MappingProxyType(
            {
                5: Tolerance(1e-5, 0.25),
                50: Tolerance(1e-5, 0.4),
                1000: Tolerance(1e-5, 0.25),
                None: Tolerance(1e-5, 0.2),
            }
        ),
        "fp8_e5m2": MappingProxyType(
            {
                5: Tolerance(1e-5, 0.4),
                50: Tolerance(1e-5, 0.6),
                1000: Tolerance(1e-5, 0.5),
                None: Tolerance(1e-5, 0.5),
            }
        ),
    }
)


def default_tolerances(kv_cache_dtype: str = "auto") -> Mapping[int | None, Tolerance]:
    """The tolerance map for a model whose KV cache is `kv_cache_dtype` (RuntimeConfig's name)."""
    return FP8_KV_TOLERANCES.get(kv_cache_dtype, DEFAULT_TOLERANCES)


# Three-way rule: how much further from fp32 than HF's own reduced-precision run ours may be.
EXPECTED_MEAN_SLACK = 1.1
EXPECTED_WORST_SLACK = 1.5


def slice_label(top_k: int | None) -> str:
    """How a slice is named in reports: 'top 5', ..., 'all'."""
    return "all" if top_k is None else f"top {top_k}"


def ordered_slices(
    tolerances: Mapping[int | None, Tolerance],
) -> list[tuple[int | None, Tolerance]]:
    """Slices from the narrowest to the whole vocabulary."""
    return sorted(tolerances.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))


# --------------------------------------------------------------------------------------------
# Comparison


@dataclass(frozen=True)
class SliceResult:
    """One top-k slice of one sequence: how close `ours` is to `ref`, position by position."""

    top_k: int | None  # None = whole vocabulary
    tolerance: Tolerance
    position_ratios: tuple[float, ...]  # per position: max|ours-ref| / (atol + rtol*max|ref|)
    worst_ratio: float
    worst_position: int
    mean_ratio: float

    @property
    def passed(self) -> bool:
        return self.worst_ratio <= 1.0


@dataclass(frozen=True)
class LogitComparison:
    """Every slice of one teacher-forced sequence, and how often the argmax agrees."""

    slices: tuple[SliceResult, ...]  # narrowest first, as `ordered_slices` sorts them
    num_positions: int
    num_greedy_agreements: int  # positions where argmax(ours) == argmax(ref)
    passed: bool  # every slice within tolerance at every position

    @property
    def greedy_agreement(self) -> float:
        return self.num_greedy_agreements / self.num_positions

    def slice(self, top_k: int | None) -> SliceResult:
        """The result for `top_k`; KeyError when it was not compared."""
        for result in self.slices:
            if result.top_k == top_k:
                return result
        raise KeyError(f"no slice {slice_label(top_k)}")


def tolerance_ratios(
    ours: torch.Tensor, ref: torch.Tensor, top_k: int | None, tolerance: Tolerance
) -> torch.Tensor:
    """[positions] max|ours-ref| / (atol + rtol * max|ref|) over the top-k tokens of `ref`.

    NaN in `ours` gives an infinite ratio, so it can never pass.
    """
    if top_k is not None and top_k < ref.shape[-1]:
        index = ref.topk(top_k, dim=-1).indices
        ours, ref = ours.gather(-1, index), ref.gather(-1, index)
    error = (ours.double() - ref.double()).abs().amax(dim=-1)
    scale = tolerance.atol + tolerance.rtol * ref.double().abs().amax(dim=-1)
    ratio = error / scale
    return torch.where(ratio.isnan(), torch.inf, ratio)


def compare_logits(
    ours: torch.Tensor,
    ref: torch.Tensor,
    tolerances: Mapping[int | None, Tolerance] = DEFAULT_TOLERANCES,
) -> LogitComparison:
    """Compare [positions, vocab] logits per slice; `passed` iff every slice is in tolerance."""
    if ours.shape != ref.shape:
        raise ValueError(f"shape mismatch: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}")
    if ref.shape[0] == 0:
        raise ValueError("no positions to compare")
    ours, ref = ours.float(), ref.float()
    slices = []
    for top_k, tolerance in ordered_slices(tolerances):
        ratios = tolerance_ratios(ours, ref, top_k, tolerance)
        worst = int(ratios.argmax())
        slices.append(
            SliceResult(
                top_k=top_k,
                tolerance=tolerance,
                position_ratios=tuple(ratios.tolist()),
                worst_ratio=float(ratios[worst]),
                worst_position=worst,
                mean_ratio=float(ratios.mean()),
            )
        )
    return LogitComparison(
        slices=tuple(slices),
        num_positions=ref.shape[0],
        num_greedy_agreements=int((ours.argmax(-1) == ref.argmax(-1)).sum()),
        passed=all(s.passed for s in slices),
    )


def slice_passes(
    worst_ratio: float,
    mean_ratio: float,
    expected_worst_ratio: float | None = None,
    expected_mean_ratio: float | None = None,
) -> bool:
    """The pass rule of the module docstring; no expected ratios = a two-way comparison."""
    if worst_ratio <= 1.0:
        return True
    if expected_worst_ratio is None or expected_mean_ratio is None:
        return False
    return (
        mean_ratio <= expected_mean_ratio * EXPECTED_MEAN_SLACK
        and worst_ratio <= expected_worst_ratio * EXPECTED_WORST_SLACK
    )


def parse_tolerances(
    overrides: Sequence[str], base: Mapping[int | None, Tolerance] = DEFAULT_TOLERANCES
) -> dict[int | None, Tolerance]:
    """`SLICE=RTOL[:ATOL]` overrides (SLICE: `top5`, `5` or `all`) applied to `base`.

    A slice not in `base` is added (its atol defaults to 1e-5). ValueError names the bad one.
    """
    tolerances = dict(base)
    for text in overrides:
        slice_text, sep, value = text.partition("=")
        slice_text = slice_text.strip().lower().removeprefix("top").strip()
        try:
            if not sep:
                raise ValueError
            top_k = None if slice_text == "all" else int(slice_text)
            rtol_text, _, atol_text = value.partition(":")
            previous = tolerances.get(top_k, Tolerance(1e-5, 0.0))
            atol = float(atol_text) if atol_text else previous.atol
            tolerance = Tolerance(atol=atol, rtol=float(rtol_text))
        except ValueError:
            raise ValueError(
                f"tolerance {text!r}: expected SLICE=RTOL[:ATOL], SLICE one of top5, 50, all"
            ) from None
        if (top_k is not None and top_k < 1) or tolerance.rtol < 0 or tolerance.atol < 0:
            raise ValueError(f"tolerance {text!r}: k must be >= 1, tolerances >= 0")
        tolerances[top_k] = tolerance
    return tolerances
