"""Tensor parallelism in the runtime: ranks in their own processes, a gloo group between them,
each running the same programs on its own slices; outputs equal one rank's."""

from __future__ import annotations

import pytest
import torch

from tests.gguf_files import GgmlType, write_gguf
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk
from vllm_aot.runtime.ranks import run_ranks
from vllm_aot.runtime.sampler import SamplingParams

PROMPTS = [[(97 * i + 13 * n) % 40000 + 100 for i in range(n)] for n in (5, 40, 90, 17)]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def _run(rank: int, model_dir, fields: dict) -> dict:
    model, _ = load_model(model_dir, RuntimeConfig(**fields), rank=rank, show_progress=False)
    generator = Generator(model)
    greedy = generator.generate([GenerationRequest(p, max_tokens=10) for p in PROMPTS])
    seeded = generator.generate([GenerationRequest(p, 10, SEEDED) for p in PROMPTS[:2]])
    logits = model.prefill_logits(PrefillChunk(PROMPTS[1], 0, [1, 2, 3]))
    return {
        "greedy": [r.token_ids for r in greedy],
        "seeded": [r.token_ids for r in seeded],
        "logits": logits,
        "kv_heads": model.kv.k[0].shape[2],
    }


def _single(model_dir, fields: dict) -> dict:
    return _run(0, model_dir, {**fields, "tensor_parallel_size": 1})


def test_two_ranks_generate_what_one_rank_does(tiny_model_dirs):
    model_dir = tiny_model_dirs("llama")
    fields = tiny_config().to_dict()
    one = _single(model_dir, fields)
    ranks = run_ranks(_run, 2, model_dir, {**fields, "tensor_parallel_size": 2})
    for rank in ranks:
        assert rank["kv_heads"] == one["kv_heads"] // 2, "each rank holds its KV heads"
        assert rank["greedy"] == one["greedy"]
        assert rank["seeded"] == ranks[0]["seeded"], "every rank samples the same tokens"
        torch.testing.assert_close(rank["logits"], one["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_biases_and_qk_norms_split_over_ranks(tiny_model_dirs, family):
    """q/k/v biases split with their heads, per-head norms stay whole."""
    model_dir = tiny_model_dirs(family)
    fields = tiny_config().to_dict()
    one = _single(model_dir, fields)
    ranks = run_ranks(_run, 2, model_dir, {**fields, "tensor_parallel_size": 2})
    assert [r["greedy"] for r in ranks] == [one["greedy"]] * 2
    torch.testing.assert_close(ranks[1]["logits"], one["logits"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)],  # same split, ~20 s
)
def test_experts_split_over_two_ranks(tiny_model_dirs, family):
    """Expert parallel (each rank 4 whole experts of 8) and tensor parallel (each expert's
    intermediate features halved): one rank's greedy text and logits."""
    model_dir = tiny_model_dirs(family)
    fields = tiny_config().to_dict()
    one = _single(model_dir, fields)
    for is_expert_parallel in (True, False):
        split = {**fields, "tensor_parallel_size": 2, "enable_expert_parallel": is_expert_parallel}
        ranks = run_ranks(_run, 2, model_dir, split)
        assert [r["greedy"] for r in ranks] == [one["greedy"]] * 2
        for rank in ranks:
            torch.testing.assert_close(rank["logits"], one["logits"], atol=1e-4, rtol=1e-4)


def test_a_linear_split_by_part_formats_splits_over_ranks(tiny_model_dirs, tmp_path):
    """Q4_K_M's mix in a Qwen2 GGUF: layer 1's v (and its bias) and down_proj in Q8_0, the rest
    Q4_0, so layer 1's qkv_proj is two runs (q|k, v), each column-sharded per part as the whole
    is: two ranks' greedy text and logits are one rank's."""
    types = {
        f"model.layers.1.{n}.weight": GgmlType.Q8_0 for n in ("self_attn.v_proj", "mlp.down_proj")
    }
    model_dir = write_gguf(
        tiny_model_dirs("qwen2"), tmp_path, family="qwen2", linear_type=GgmlType.Q4_0, types=types
    )
    fields = tiny_config(quantization="gguf").to_dict()
    one = _single(model_dir, fields)
    ranks = run_ranks(_run, 2, model_dir, {**fields, "tensor_parallel_size": 2})
    assert [r["greedy"] for r in ranks] == [one["greedy"]] * 2
    torch.testing.assert_close(ranks[1]["logits"], one["logits"], atol=1e-4, rtol=1e-4)


def test_a_split_that_does_not_divide_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not split evenly over .* 3"):
        load_model(tiny_model_dir, tiny_config(tensor_parallel_size=3), show_progress=False)


def _smollm2_config(**fields) -> dict:
    return tiny_config(max_num_seqs=4, max_model_len=256, **fields).to_dict()


@pytest.mark.slow  # ~35 s each; the tiny models' splits and test_gguf's planes stay fast
@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_smollm2_on_three_ranks(default_model_dir, quantization):
    """9 heads, 3 KV heads over 3 ranks; the GGUF's Q4_1 rows split block by block."""
    fields = _smollm2_config(quantization=quantization)
    one = _single(default_model_dir, fields)
    ranks = run_ranks(_run, 3, default_model_dir, {**fields, "tensor_parallel_size": 3})
    for rank in ranks:
        assert rank["kv_heads"] == 1
        assert rank["greedy"] == one["greedy"]
        torch.testing.assert_close(rank["logits"], one["logits"], atol=2e-3, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "is_expert_parallel"), [("llama", False), ("mixtral", True)])
def test_compiled_programs_call_the_collectives(tiny_model_dirs, family, is_expert_parallel):
    """AOTInductor programs reach the installed communicator through torch's dispatcher (and,
    expert-parallel, the experts kernel with the rank's first expert among their inputs: one
    program for both ranks; ~50 s here)."""
    model_dir = tiny_model_dirs(family)
    fields = tiny_config(backend="inductor", max_num_seqs=1).to_dict()
    fields.update(decode_context_buckets=(256,))
    one = _single(model_dir, {**fields, "backend": "eager"})
    split = {"tensor_parallel_size": 2, "enable_expert_parallel": is_expert_parallel}
    ranks = run_ranks(_run, 2, model_dir, {**fields, **split})
    assert [r["greedy"] for r in ranks] == [one["greedy"]] * 2


def test_programs_and_the_registry_are_keyed_by_the_rank_count(tiny_model_dir, tiny_model_dirs):
    """One set of programs serves every rank of a size; another size is another set."""
    from vllm_aot.cache.keys import program_cache_key
    from vllm_aot.cache.registry import CompiledConfiguration, describe_rows
    from vllm_aot.models.source import load_arch
    from vllm_aot.runtime.programs import all_program_keys

    arch = load_arch(tiny_model_dir)
    one, two = tiny_config(), tiny_config(tensor_parallel_size=2)
    keys = all_program_keys(two)
    assert keys == all_program_keys(one)
    for key in keys:
        assert program_cache_key(arch, one, key) != program_cache_key(arch, two, key)
    expert_parallel = tiny_config(tensor_parallel_size=2, enable_expert_parallel=True)
    moe = load_arch(tiny_model_dirs("mixtral"))
    for key in keys:  # whole experts per rank, or every expert's slice: other programs
        assert program_cache_key(moe, two, key) != program_cache_key(moe, expert_parallel, key)
    record = CompiledConfiguration.build(arch, two, {})
    header, row = describe_rows([record])
    assert record.tensor_parallel_size == 2 and row[header.index("TP")] == "2"
