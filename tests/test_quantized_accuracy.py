"""Validation of quantised configurations: ours against HF on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.accuracy.logits import teacher_forcing_sequences, validate
from vllm_aot.accuracy.prompts import chat_prompt_token_ids
from vllm_aot.accuracy.teacher_forcing import HFReference
from vllm_aot.loading.startup import load_model


@pytest.fixture(scope="module")
def tiny_prompt_lengths(tiny_model_dirs) -> list[int]:
    return [len(p) for p in chat_prompt_token_ids(tiny_model_dirs("llama"))]


@pytest.fixture(scope="module")
def tiny_sequences(tiny_model_dirs) -> list[list[int]]:
    """The chat prompts, each followed by 16 of the tiny llama's greedy tokens (HF, fp32)."""
    model_dir = tiny_model_dirs("llama")
    prompts = chat_prompt_token_ids(model_dir)
    return teacher_forcing_sequences(HFReference(model_dir), prompts, 16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_validate_against_hf_on_the_same_weights(
    tiny_model_dirs, tiny_sequences, tiny_prompt_lengths, dtype
):
    """int8 is compared with HF computing on the int8 weights (dequantised); in bfloat16 the
    three-way baseline stays HF fp32 on the original weights."""
    from vllm_aot.accuracy.quantized import simulation_for

    model_dir = tiny_model_dirs("llama")
    config = tiny_config(dtype=dtype, quantization="int8", backend="eager")
    model, _ = load_model(model_dir, config, show_progress=False)
    reference = HFReference(model_dir, simulation_for(model.arch, model.config))
    three_way = dtype != "float32"
    report = validate(
        model_dir,
        model,
        tiny_sequences,
        prompt_lengths=tiny_prompt_lengths,
        three_way=three_way,
        reference=reference,
    )
    assert report.passed, report.format_summary()
    original = HFReference(model_dir).logits(tiny_sequences[0])
    simulated = reference.logits(tiny_sequences[0])
    assert not torch.equal(original, simulated)  # the simulation changed the weights
