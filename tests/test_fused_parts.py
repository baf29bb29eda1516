"""A fused linear whose parts a GGUF stores in different types (llama.cpp's Q4_K_M keeps some
layers' `attn_v` in more bits than `attn_q` and `attn_k`): its parts named apart, split into
runs of them where they differ, served equal to the dense model of the dequantised weights."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_files import GgmlType, transformers_weights, write_dense_twin, write_gguf
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk

# Q4_K_M's own mix: v alone of qkv_proj's parts, and down_proj, in more bits (layer 1 here).
V_AND_DOWN = {
    f"model.layers.1.{n}.weight": GgmlType.Q8_0 for n in ("self_attn.v_proj", "mlp.down_proj")
}
PROMPTS = ([1, 450, 4996, 17354, 1701], [1, 3681, 338])


def q4_k_m_like(tiny_model_dirs, tmp_path, family: str):
    """(the GGUF directory of the tiny `family` model in Q4_0 with `V_AND_DOWN` in Q8_0, the
    dense directory of its dequantised weights)."""
    hf_dir = tiny_model_dirs(family)
    model_dir = write_gguf(
        hf_dir, tmp_path / "gguf", family=family, linear_type=GgmlType.Q4_0, types=V_AND_DOWN
    )
    weights = transformers_weights(model_dir, hf_dir, family)
    return model_dir, write_dense_twin(model_dir, weights, tmp_path / "dense")


def greedy(model) -> list[list[int]]:
    requests = [GenerationRequest(list(p), max_tokens=8, ignore_eos=True) for p in PROMPTS]
    return [r.token_ids for r in Generator(model).generate(requests)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases split with them
def test_fused_parts_stored_in_other_types_serve_as_split_linears(
    tiny_model_dirs, tmp_path, family
):
    """Q4_K_M's mix: layer 1 keeps v and down_proj in Q8_0, q and k Q4_0 as every other linear.
    Layer 1's group splits qkv_proj into q|k (Q4_0) and v (Q8_0), each stored and multiplied
    in its own format; group 0 keeps it whole. Logits and greedy output equal the dense model's
    of the dequantised weights."""
    model_dir, dense_dir = q4_k_m_like(tiny_model_dirs, tmp_path, family)
    formats = (("*", "q4_0"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))
    groups = (((1,), (("down_proj", "q8_0"), ("qkv_proj.2", "q8_0"))),)
    assert resolve_weight_formats(model_dir, "gguf", torch.float32) == (formats, groups)
    model, _ = load_model(model_dir, tiny_config(quantization="gguf"))
    whole, split = model.weights.layers
    assert "qkv_proj.qweight" in whole and "qkv_proj.qweight" not in split
    assert split["qkv_proj.0.qweight"].dtype == torch.uint8  # q|k: Q4_0's nibbles
    assert split["qkv_proj.2.qweight"].dtype == torch.int8  # v: Q8_0's bytes
    arch = model.arch
    assert split["qkv_proj.0.scale"].shape[0] == arch.q_size + arch.kv_size
    assert split["qkv_proj.2.scale"].shape[0] == arch.kv_size
    if family == "qwen2":  # the biases split with their parts
        assert split["qkv_proj.0.bias"].shape[0] == arch.q_size + arch.kv_size
        assert split["qkv_proj.2.bias"].shape[0] == arch.kv_size
    dense, _ = load_model(dense_dir, tiny_config())
    chunk = PrefillChunk(list(PROMPTS[0]) * 3, 0, [1])
    torch.testing.assert_close(
        model.prefill_logits(chunk), dense.prefill_logits(chunk), atol=1e-4, rtol=1e-4
    )
    assert greedy(model) == greedy(dense)


def test_the_accuracy_tools_capture_the_layers_of_split_linears(tiny_model_dirs, tmp_path):
    """Sub-layer capture (each layer's instrumented program in its group's formats) of Q4_K_M's
    mix matches HF on the dequantised weights at every module."""
    from vllm_aot.accuracy.capture import capture_hf, capture_ours
    from vllm_aot.accuracy.teacher_forcing import HFReference
    from vllm_aot.accuracy.tensor_compare import compare_captures

    model_dir, dense_dir = q4_k_m_like(tiny_model_dirs, tmp_path, "llama")
    model, _ = load_model(model_dir, tiny_config(quantization="gguf"))
    sequence = list(PROMPTS[0]) * 4
    ours = capture_ours(model, sequence)
    hf = capture_hf(HFReference(dense_dir), sequence, torch.float32)
    assert "model.layers.1.self_attn.value_states" in ours.names and ours.names == hf.names
    comparison = compare_captures(ours, hf)
    assert comparison.passed, comparison.verdict()


def test_each_fused_part_stored_otherwise_is_named(tiny_model_dirs, tmp_path):
    """k in Q8_0 in layer 0 and up in Q8_0 in layer 1: every part of those linears is named
    (the ones equal to "*" dropped), each layer its own group."""
    types = {
        "model.layers.0.self_attn.k_proj.weight": GgmlType.Q8_0,
        "model.layers.1.mlp.up_proj.weight": GgmlType.Q8_0,
    }
    hf_dir = tiny_model_dirs("llama")
    model_dir = write_gguf(hf_dir, tmp_path, family="llama", linear_type=GgmlType.Q4_1, types=types)
    formats, groups = resolve_weight_formats(model_dir, "gguf", torch.float32)
    assert formats == (
        ("*", "q4_1"),
        ("embed_tokens", "q8_0"),
        ("lm_head", "q8_0"),
        ("qkv_proj.1", "q8_0"),
    )
    assert groups == (((1,), (("gate_up_proj.1", "q8_0"), ("qkv_proj.1", "q4_1"))),)
    model, _ = load_model(model_dir, tiny_config(quantization="gguf"))
    names = [sorted(n for n in layer if n.endswith("qweight")) for layer in model.weights.layers]
    assert names == [
        [
            "down_proj.qweight",
            "gate_up_proj.qweight",
            "o_proj.qweight",
            "qkv_proj.0.qweight",
            "qkv_proj.1.qweight",
            "qkv_proj.2.qweight",
        ],
        [
            "down_proj.qweight",
            "gate_up_proj.0.qweight",
            "gate_up_proj.1.qweight",
            "o_proj.qweight",
            "qkv_proj.qweight",
        ],
    ]
