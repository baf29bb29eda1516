"""Logit validation against HF transformers: tiny random models (fast) and SmolLM2 (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.accuracy.logit_tolerance import (
    DEFAULT_TOLERANCES,
    Tolerance,
    compare_logits,
    slice_passes,
)
from vllm_aot.accuracy.logits import greedy_match, teacher_forcing_sequences, validate
from vllm_aot.accuracy.prompts import CHAT_PROMPTS, chat_prompt_token_ids
from vllm_aot.accuracy.teacher_forcing import HFReference, our_logits
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKind

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def _failure_message(report) -> str:
    return "\n" + report.format_summary()


# --------------------------------------------------------------------------------------------
# The comparison itself, on hand-made logits


def test_identical_logits_pass_every_slice_and_agree_greedily():
    ref = torch.randn(6, 2000) * 5
    comparison = compare_logits(ref.clone(), ref)
    assert comparison.passed
    assert [s.worst_ratio for s in comparison.slices] == [0.0] * len(DEFAULT_TOLERANCES)
    assert comparison.greedy_agreement == 1.0


def test_error_in_a_top_token_fails_the_narrow_slices_at_that_position():
    ref = torch.randn(6, 2000) * 5
    ours = ref.clone()
    top = int(ref[3].argmax())
    ours[3, top] += 0.05 * ref[3].abs().max()  # 5 % of the logit scale: beyond top-5's 1.1 %
    comparison = compare_logits(ours, ref)
    assert not comparison.passed
    top5 = comparison.slice(5)
    assert not top5.passed
    assert top5.worst_position == 3
    assert top5.position_ratios[0] == 0.0
    assert comparison.slice(None).passed  # 5 % is within the whole vocabulary's tolerance


def test_nan_logits_never_pass():
    ref = torch.randn(3, 100)
    ours = ref.clone()
    ours[1, 7] = float("nan")
    comparison = compare_logits(ours, ref, {None: Tolerance(1.0, 1.0)})
    assert not comparison.passed
    assert comparison.slices[0].worst_position == 1


def test_three_way_rule_forgives_what_hf_in_the_same_dtype_also_does():
    assert slice_passes(0.9, 0.5)  # within tolerance of fp32
    assert not slice_passes(3.0, 1.0)  # two-way: over tolerance fails
    assert slice_passes(3.0, 1.0, expected_worst_ratio=2.5, expected_mean_ratio=1.0)
    # Ours is worse on average than HF in the same dtype: a precision loss of our own.
    assert not slice_passes(3.0, 1.5, expected_worst_ratio=3.0, expected_mean_ratio=1.0)
    # A few positions far off while the average looks fine: a localised bug.
    assert not slice_passes(30.0, 1.0, expected_worst_ratio=3.0, expected_mean_ratio=1.0)


# --------------------------------------------------------------------------------------------
# Tiny random models against HF (fast)


@pytest.fixture(scope="module")
def tiny_prompts(tiny_model_dirs) -> list[list[int]]:
    """The 8 chat prompts (35-46 tokens: one chunk of tiny_config's 64-token prefill bucket)."""
    return chat_prompt_token_ids(tiny_model_dirs("llama"))


@pytest.fixture(scope="module")
def tiny_prompt_lengths(tiny_prompts) -> list[int]:
    return [len(p) for p in tiny_prompts]


@pytest.fixture(scope="module")
def tiny_sequences(tiny_model_dirs, tiny_prompts) -> list[list[int]]:
    """The 8 chat prompts, each followed by the tiny llama's own 32 greedy tokens (HF, fp32).

    Every tiny family shares the SmolLM2 tokenizer, so these sequences serve all of them. They
    are 67-78 tokens long: longer than tiny_config's 64-token prefill bucket, so prefilling a
    whole sequence (`our_logits`) takes two chunks, the second reading the first from the paged
    cache.
    """
    reference = HFReference(tiny_model_dirs("llama"))
    return teacher_forcing_sequences(reference, tiny_prompts, num_tokens=32)


@pytest.fixture(scope="module")
def tiny_references(tiny_model_dirs):
    """family -> HFReference, kept for the module so each HF model loads once."""
    made: dict[str, HFReference] = {}

    def get(family: str) -> HFReference:
        if family not in made:
            made[family] = HFReference(tiny_model_dirs(family))
        return made[family]

    return get


def test_chat_prompts_end_with_the_assistant_header(default_model_dir):
    from transformers import AutoTokenizer

    sequences = chat_prompt_token_ids(default_model_dir)
    assert len(sequences) == len(CHAT_PROMPTS) >= 8
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    for prompt, ids in zip(CHAT_PROMPTS, sequences, strict=True):
        assert all(type(t) is int for t in ids)
        text = tokenizer.decode(ids)
        assert prompt in text
        assert text.endswith("<|im_start|>assistant\n")


def test_tiny_sequences_are_fed_in_several_chunks(tiny_sequences):
    chunk = max(tiny_config().prefill_token_buckets)
    assert all(len(s) > chunk for s in tiny_sequences)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_match_hf(
    family, tiny_model_dirs, tiny_references, tiny_sequences, tiny_prompt_lengths
):
    model_dir = tiny_model_dirs(family)
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    report = validate(
        model_dir,
        model,
        tiny_sequences,
        prompt_lengths=tiny_prompt_lengths,
        three_way=False,
        reference=tiny_references(family),
    )
    assert report.passed, _failure_message(report)
    assert report.greedy_agreement == 1.0, _failure_message(report)


def test_whole_sequences_prefilled_match_hf(tiny_model_dirs, tiny_references, tiny_sequences):
    model_dir = tiny_model_dirs("llama")
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    report = validate(
        model_dir,
        model,
        tiny_sequences,
        prompt_lengths=None,
        three_way=False,
        reference=tiny_references("llama"),
    )
    assert report.passed, _failure_message(report)
    steps = {key.kind: 0 for key in model.num_executions}
    for key, n in model.num_executions.items():
        steps[key.kind] += n
    # Two chunks per sequence, the second reading the first from the cache; no decode step.
    assert steps[ProgramKind.PREFILL] == 2 * len(tiny_sequences)
    assert steps[ProgramKind.DECODE] == 0


def test_continuation_logits_come_from_decode_programs(
    tiny_model_dirs, tiny_references, tiny_sequences, tiny_prompt_lengths
):
    model_dir = tiny_model_dirs("llama")
    config = tiny_config()
    model, _ = load_model(model_dir, config, show_progress=False)
    report = validate(
        model_dir,
        model,
        tiny_sequences,
        prompt_lengths=tiny_prompt_lengths,
        three_way=False,
        reference=tiny_references("llama"),
    )
    assert report.passed, _failure_message(report)
    assert report.greedy_agreement == 1.0, _failure_message(report)
    steps = {key: n for key, n in model.num_executions.items() if n and key.is_layer}
    prefill_steps = sum(n for key, n in steps.items() if key.kind is ProgramKind.PREFILL)
    decode_steps = {key.size: n for key, n in steps.items() if key.kind is ProgramKind.DECODE}
    # One prefill chunk per prompt and nothing more: the continuations went through decode.
    assert prefill_steps == len(tiny_sequences)
    # 8 sequences x 32 tokens, at most 4 rows a step; sequences join one per step and leave
    # after their 32nd token, so every batch bucket runs, 4 with 3 real rows and a padded one.
    assert sum(decode_steps.values()) >= len(tiny_sequences) * 32 / config.max_num_seqs
    assert sorted(decode_steps) == list(config.decode_batch_buckets) == [1, 2, 4]
    # Teacher-forced decode gives the logits prefill gives, position for position (fp32).
    prefilled = our_logits(model, tiny_sequences[0])
    decoded = our_logits(model, tiny_sequences[0], num_prompt_tokens=tiny_prompt_lengths[0])
    torch.testing.assert_close(decoded, prefilled, rtol=0, atol=1e-4)


def test_bf16_is_no_further_from_fp32_than_hf_bf16(
    tiny_model_dirs, tiny_references, tiny_sequences, tiny_prompt_lengths
):
    model_dir = tiny_model_dirs("llama")
    model, _ = load_model(model_dir, tiny_config(dtype="bfloat16"), show_progress=False)
    report = validate(
        model_dir,
        model,
        tiny_sequences,
        prompt_lengths=tiny_prompt_lengths,
        three_way=True,
        reference=tiny_references("llama"),
    )
    assert report.is_three_way
    assert report.passed, _failure_message(report)
    # bf16 costs some argmax agreement with fp32, but not most of it.
    assert report.greedy_agreement > 0.8, _failure_message(report)


def test_greedy_generation_matches_hf(tiny_model_dirs, tiny_references):
    model_dir = tiny_model_dirs("llama")
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    prompts = chat_prompt_token_ids(model_dir)
    results = greedy_match(model_dir, model, prompts, 16, reference=tiny_references("llama"))
    assert len(results) == len(prompts)
    for prompt, result in zip(CHAT_PROMPTS, results, strict=True):
        assert len(result.ours) == 16
        assert result.is_match, f"{prompt!r}: diverges at token {result.num_matching}"


def test_a_corrupted_layer_fails_validation(
    tiny_model_dirs, tiny_references, tiny_sequences, tiny_prompt_lengths
):
    model_dir = tiny_model_dirs("llama")
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    # In place, so the flattened weight tuples the programs receive see it too.
    model.weights.layers[0]["o_proj.weight"].mul_(1.05)
    report = validate(
        model_dir,
        model,
        tiny_sequences[:2],
        prompt_lengths=tiny_prompt_lengths[:2],
        three_way=False,
        reference=tiny_references("llama"),
    )
    assert not report.passed
    assert not report.slice(5).passed
    assert report.slice(5).worst_ratio > 1.5
    assert any(row[-1] == "FAIL" for row in report.summary_rows()[1:])


def test_a_corrupted_bf16_layer_fails_three_way(
    tiny_model_dirs, tiny_references, tiny_sequences, tiny_prompt_lengths
):
    model_dir = tiny_model_dirs("llama")
    model, _ = load_model(model_dir, tiny_config(dtype="bfloat16"), show_progress=False)
    model.weights.layers[0]["o_proj.weight"].mul_(1.05)
    report = validate(
        model_dir,
        model,
        tiny_sequences[:2],
        prompt_lengths=tiny_prompt_lengths[:2],
        three_way=True,
        reference=tiny_references("llama"),
    )
    # bf16 noise is forgiven only up to what HF's own bf16 shows; an error of ours is not.
    assert not report.passed, _failure_message(report)
    top5 = report.slice(5)
    assert top5.mean_ratio > 1.1 * top5.expected_mean_ratio, _failure_message(report)


def test_too_long_a_sequence_is_refused_by_name(tiny_model_dir):
    config = tiny_config()
    model, _ = load_model(tiny_model_dir, config, show_progress=False)
    with pytest.raises(ValueError, match="max_model_len"):
        our_logits(model, [1] * (config.max_model_len + 1))
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        our_logits(model, [1] * 8, num_prompt_tokens=0)


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct against HF (slow)


def _smollm_config(dtype: str, **overrides) -> RuntimeConfig:
    fields = dict(
        max_num_seqs=8,
        max_model_len=512,
        max_num_batched_tokens=128,
        dtype=dtype,
        backend="eager",
    )
    fields.update(overrides)
    return RuntimeConfig(**fields)


@pytest.fixture(scope="module")
def smollm_reference(default_model_dir) -> HFReference:
    return HFReference(default_model_dir)


@pytest.fixture(scope="module")
def smollm_prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_token_ids(default_model_dir)


@pytest.fixture(scope="module")
def smollm_sequences(smollm_reference, smollm_prompts) -> list[list[int]]:
    """Chat prompts plus SmolLM2's own 32 greedy tokens (HF fp32, remembered by the reference)."""
    return teacher_forcing_sequences(smollm_reference, smollm_prompts, num_tokens=32)


def _validate_smollm(model_dir, model, reference, prompts, sequences, *, three_way: bool):
    lengths = [len(p) for p in prompts]
    return validate(
        model_dir,
        model,
        sequences,
        prompt_lengths=lengths,
        three_way=three_way,
        reference=reference,
    )


@pytest.mark.slow
def test_smollm_fp32_logits_match_hf(
    default_model_dir, smollm_reference, smollm_prompts, smollm_sequences
):
    model, _ = load_model(default_model_dir, _smollm_config("float32"), show_progress=False)
    report = _validate_smollm(
        default_model_dir,
        model,
        smollm_reference,
        smollm_prompts,
        smollm_sequences,
        three_way=False,
    )
    assert report.passed, _failure_message(report)
    assert report.greedy_agreement == 1.0, _failure_message(report)


@pytest.mark.slow
def test_smollm_fp32_greedy_matches_hf(default_model_dir, smollm_reference, smollm_prompts):
    model, _ = load_model(default_model_dir, _smollm_config("float32"), show_progress=False)
    results = greedy_match(default_model_dir, model, smollm_prompts, 32, reference=smollm_reference)
    for prompt, result in zip(CHAT_PROMPTS, results, strict=True):
        assert result.is_match, f"{prompt!r}: diverges at token {result.num_matching}"


@pytest.mark.slow
def test_smollm_bf16_is_no_further_from_fp32_than_hf_bf16(
    default_model_dir, smollm_reference, smollm_prompts, smollm_sequences
):
    model, _ = load_model(default_model_dir, _smollm_config("bfloat16"), show_progress=False)
    report = _validate_smollm(
        default_model_dir, model, smollm_reference, smollm_prompts, smollm_sequences, three_way=True
    )
    assert report.passed, _failure_message(report)


@pytest.mark.slow
def test_smollm_fp32_inductor_logits_match_hf(
    default_model_dir, smollm_reference, smollm_prompts, smollm_sequences, tmp_path: Path
):
    config = _smollm_config(
        "float32",
        backend="inductor",
        decode_batch_buckets=(8,),
        decode_context_buckets=(512,),
        prefill_token_buckets=(128,),
    )
    cache = ProgramCache(CacheSettings(root=tmp_path / "cache"))
    model, load_report = load_model(default_model_dir, config, cache=cache, show_progress=False)
    assert load_report.compiled, "a fresh cache must compile its programs"
    report = _validate_smollm(
        default_model_dir,
        model,
        smollm_reference,
        smollm_prompts,
        smollm_sequences,
        three_way=False,
    )
    assert report.passed, _failure_message(report)
    assert report.greedy_agreement == 1.0, _failure_message(report)
