"""Logit validation of a CompiledModel against HF transformers.

Teacher forcing: both models read the same token sequence (a chat prompt, usually followed by
HF's own greedy continuation, so positions cover generated text too) and produce logits at every
position. Ours go through the real serving path, as serving produces them
(`teacher_forcing.teacher_forced_logits`): prompt positions from prefill programs, chunk by chunk
when the prompt is longer than the largest prefill bucket; continuation positions from decode
programs, one token per step, the sequences sharing decode batches that they join and leave at
different steps (so batch buckets above 1 with padded rows run too).

The comparison rule and tolerances are in `comparison.py`.

`greedy_match` checks free-running output: our Generator's greedy tokens against
`hf_model.generate(do_sample=False)`, both ignoring EOS so they run the full length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_aot.accuracy.logit_tolerance import (
    LogitComparison,
    Tolerance,
    compare_logits,
    default_tolerances,
    ordered_slices,
    slice_label,
    slice_passes,
)
from vllm_aot.accuracy.teacher_forcing import (
    HFReference,
    TokenIds,
    teacher_forced_logits,
)
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.model import CompiledModel

# --------------------------------------------------------------------------------------------
# Validation over prompts


@dataclass(frozen=True)
class SliceVerdict:
    """One slice over every position of every prompt: worst and mean case, and the verdict."""

    top_k: int | None
    tolerance: Tolerance
    worst_ratio: float  # ours vs reference (the fp32 baseline in three-way mode)
    worst_prompt: int
    worst_position: int
    mean_ratio: float
    expected_worst_ratio: float | None  # three-way: HF in the served dtype vs the fp32 baseline
    expected_mean_ratio: float | None
    passed: bool


@dataclass(frozen=True)
class ValidationReport:
    """Teacher-forced validation over a set of prompts; `passed` iff every slice passes."""

    dtype: str  # the dtype our model serves in
    is_three_way: bool
    slices: tuple[SliceVerdict, ...]
    prompts: tuple[LogitComparison, ...]  # ours vs reference, per prompt
    expected_prompts: tuple[LogitComparison, ...]  # three-way: HF served dtype vs baseline
    passed: bool

    @property
    def greedy_agreement(self) -> float:
        """Fraction of all positions where our argmax is the reference's."""
        return _pooled_agreement(self.prompts)

    @property
    def expected_greedy_agreement(self) -> float | None:
        """Three-way: the same fraction for HF in the served dtype."""
        return _pooled_agreement(self.expected_prompts) if self.is_three_way else None

    def slice(self, top_k: int | None) -> SliceVerdict:
        """The verdict for `top_k`; KeyError when it was not compared."""
        for verdict in self.slices:
            if verdict.top_k == top_k:
                return verdict
        raise KeyError(f"no slice {slice_label(top_k)}")

    def summary_rows(self) -> list[tuple[str, ...]]:
        """A table, header row first: per slice the worst and mean ratio (ours, and HF in our
        dtype when three-way), where the worst case is, and PASS/FAIL."""
        header = ("slice", "worst ratio", "mean ratio")
        if self.is_three_way:
            header += ("HF worst", "HF mean")
        rows = [(*header, "worst at", "result")]
        for v in self.slices:
            row = (slice_label(v.top_k), f"{v.worst_ratio:.3g}", f"{v.mean_ratio:.3g}")
            if self.is_three_way:
                row += (f"{v.expected_worst_ratio:.3g}", f"{v.expected_mean_ratio:.3g}")
            where = f"prompt {v.worst_prompt} pos {v.worst_position}"
            rows.append((*row, where, "PASS" if v.passed else "FAIL"))
        return rows

    def format_summary(self) -> str:
        """The summary rows as an aligned text table, with a title and greedy agreement."""
        rows = self.summary_rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        agreement = f"greedy agreement {self.greedy_agreement:.1%}"
        if self.expected_greedy_agreement is not None:
            agreement += f" (HF {self.dtype}: {self.expected_greedy_agreement:.1%})"
        mode = "three-way (ratios vs HF float32)" if self.is_three_way else "two-way"
        title = f"{mode} validation of {self.dtype}: {'PASS' if self.passed else 'FAIL'}"
        return "\n".join([title, *lines, agreement])


def _pooled_agreement(comparisons: Sequence[LogitComparison]) -> float:
    num_positions = sum(c.num_positions for c in comparisons)
    return sum(c.num_greedy_agreements for c in comparisons) / max(num_positions, 1)


def _reference_for(model_dir: str | Path, reference: HFReference | None) -> HFReference:
    if reference is None:
        return HFReference(model_dir)
    if reference.model_dir.resolve() != Path(model_dir).resolve():
        raise ValueError(f"reference is of {reference.model_dir}, not of {model_dir}")
    return reference


def _worst(comparisons: Sequence[LogitComparison], index: int) -> tuple[float, int, int]:
    """(ratio, prompt, position) of the worst case of slice `index` over the comparisons."""
    return max(
        (c.slices[index].worst_ratio, p, c.slices[index].worst_position)
        for p, c in enumerate(comparisons)
    )


def _mean(comparisons: Sequence[LogitComparison], index: int) -> float:
    """Mean ratio of slice `index` over every position of every comparison."""
    total = sum(c.slices[index].mean_ratio * c.num_positions for c in comparisons)
    return total / sum(c.num_positions for c in comparisons)


def validate(
    model_dir: str | Path,
    model: CompiledModel,
    sequences: Sequence[TokenIds],
    *,
    prompt_lengths: Sequence[int] | None,
    three_way: bool,
    tolerances: Mapping[int | None, Tolerance] | None = None,
    reference: HFReference | None = None,
) -> ValidationReport:
    """Teacher-forced logits of `model` against HF on every sequence, aggregated per slice.

    `prompt_lengths[i]` leading tokens of sequence i are fed through prefill programs and the
    rest (the continuation) through decode programs, all sequences sharing decode batches
    (`teacher_forced_logits`); None feeds whole sequences through prefill programs only, leaving
    decode programs unchecked. Two-way: the reference is HF in our model's dtype and a slice
    passes only if it is within tolerance at every position. Three-way: the reference is HF in
    fp32 and HF in our dtype is the expected deviation (rule in the module docstring).
    `tolerances` default to `default_tolerances` of the model's KV cache dtype.
    `reference` reuses already loaded HF models of `model_dir`. `passed` is True only if every
    slice passes.
    """
    if not sequences:
        raise ValueError("no prompts to validate")
    reference = _reference_for(model_dir, reference)
    if tolerances is None:
        tolerances = default_tolerances(model.config.kv_cache_dtype)
    if prompt_lengths is None:
        prompt_lengths = [len(token_ids) for token_ids in sequences]
    ours = teacher_forced_logits(model, sequences, prompt_lengths)
    dtype = model.config.torch_dtype
    baseline_dtype = torch.float32 if three_way else dtype
    target, expected = [], []
    for token_ids, our_logits in zip(sequences, ours, strict=True):
        baseline = reference.logits(token_ids, baseline_dtype, original=three_way)
        target.append(compare_logits(our_logits, baseline, tolerances))
        if three_way:
            hf_served = reference.logits(token_ids, dtype)
            expected.append(compare_logits(hf_served, baseline, tolerances))
    verdicts = []
    for index, (top_k, tolerance) in enumerate(ordered_slices(tolerances)):
        worst, prompt, position = _worst(target, index)
        mean = _mean(target, index)
        expected_worst = _worst(expected, index)[0] if three_way else None
        expected_mean = _mean(expected, index) if three_way else None
        verdicts.append(
            SliceVerdict(
                top_k=top_k,
                tolerance=tolerance,
                worst_ratio=worst,
                worst_prompt=prompt,
                worst_position=position,
                mean_ratio=mean,
                expected_worst_ratio=expected_worst,
                expected_mean_ratio=expected_mean,
                passed=slice_passes(worst, mean, expected_worst, expected_mean),
            )
        )
    return ValidationReport(
        dtype=model.config.dtype,
        is_three_way=three_way,
        slices=tuple(verdicts),
        prompts=tuple(target),
        expected_prompts=tuple(expected),
        passed=all(v.passed for v in verdicts),
    )


# --------------------------------------------------------------------------------------------
# Free-running greedy output


def teacher_forcing_sequences(
    reference: HFReference, prompts: Sequence[TokenIds], num_tokens: int = 32
) -> list[list[int]]:
    """Each prompt followed by HF fp32's greedy continuation of exactly `num_tokens` tokens."""
    return [list(p) + reference.greedy(p, num_tokens, torch.float32) for p in prompts]


@dataclass(frozen=True)
class GreedyComparison:
    """Greedy tokens after one prompt: ours and HF's, in the same dtype."""

    prompt_token_ids: tuple[int, ...]
    ours: tuple[int, ...]
    reference: tuple[int, ...]

    @property
    def is_match(self) -> bool:
        return self.ours == self.reference

    @property
    def num_matching(self) -> int:
        """Length of the common prefix: where the two outputs first diverge."""
        for i, (a, b) in enumerate(zip(self.ours, self.reference, strict=False)):
            if a != b:
                return i
        return min(len(self.ours), len(self.reference))


def greedy_match(
    model_dir: str | Path,
    model: CompiledModel,
    prompts: Sequence[TokenIds],
    num_tokens: int = 32,
    *,
    reference: HFReference | None = None,
) -> list[GreedyComparison]:
    """Our greedy output vs `hf_model.generate(do_sample=False)` for each prompt, in order.

    Both run exactly `num_tokens` tokens (EOS ignored), HF in our model's dtype; ours through a
    Generator that batches all prompts, as serving would. Raises ValueError when a prompt plus
    `num_tokens` does not fit max_model_len.
    """
    limit = model.config.max_model_len
    for p in prompts:
        if len(p) + num_tokens > limit:
            raise ValueError(f"{len(p)} prompt + {num_tokens} tokens exceed max_model_len {limit}")
    reference = _reference_for(model_dir, reference)
    requests = [GenerationRequest(list(p), max_tokens=num_tokens, ignore_eos=True) for p in prompts]
    with torch.no_grad():
        results = Generator(model).generate(requests)
    dtype = model.config.torch_dtype
    return [
        GreedyComparison(
            prompt_token_ids=tuple(p),
            ours=tuple(result.token_ids),
            reference=tuple(reference.greedy(p, num_tokens, dtype)),
        )
        for p, result in zip(prompts, results, strict=True)
    ]
