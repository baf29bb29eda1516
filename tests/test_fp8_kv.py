"""The FP8 KV cache: pools of one byte an element, K/V stored as value / scale, read back
dequantised by prefill, the pure-torch decode attention and the kernel; logits within the
documented tolerance of HF's (tiny models, eager unless the compile is the point)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import run_vllm_aot, tiny_arch, tiny_config
from vllm_aot.accuracy.logit_tolerance import default_tolerances
from vllm_aot.accuracy.logits import validate
from vllm_aot.accuracy.prompts import chat_prompt_token_ids
from vllm_aot.accuracy.teacher_forcing import HFReference
from vllm_aot.cli.main import main
from vllm_aot.loading.startup import load_model
from vllm_aot.models.source import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.kv_cache import KVCache
from vllm_aot.runtime.programs import ProgramKind, all_program_keys, build_module, example_args
from vllm_aot.runtime.signature import flatten

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_pools_hold_twice_the_blocks_of_bfloat16_in_the_same_bytes(kv_cache_dtype):
    config = tiny_config(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    assert config.kv_torch_dtype == FP8[kv_cache_dtype]
    arch = tiny_arch()
    bf16 = KVCache(arch, num_blocks=10, block_size=16, dtype=torch.bfloat16)
    fp8 = KVCache(arch, num_blocks=20, block_size=16, dtype=config.kv_torch_dtype)
    assert fp8.k[0].dtype == fp8.v[1].dtype == FP8[kv_cache_dtype]
    assert sum(p.nbytes for p in fp8.k + fp8.v) == sum(p.nbytes for p in bf16.k + bf16.v)


def test_writes_store_value_over_scale_saturated_and_read_back_dequantised():
    arch = tiny_arch()
    scales = [(0.5, 4.0), (1.0, 1.0)]
    kv = KVCache(arch, num_blocks=4, block_size=16, dtype=torch.float8_e4m3fn, scales=scales)
    k = torch.linspace(-300, 300, 2 * arch.kv_size).view(2, arch.num_kv_heads, arch.head_dim)
    v = k.flip(0) / 100
    kv.write(0, torch.tensor([17, 18]), k, v)  # block 1, positions 1 and 2
    stored = kv.k[0][1, 1:3].float()
    assert stored.abs().max() == 448  # 300 / 0.5 saturates to e4m3's largest finite value
    torch.testing.assert_close(stored, (k / 0.5).clamp(-448, 448), rtol=2**-4, atol=2**-9)
    k_read, v_read = kv.gather(0, [1], 3)
    assert k_read.dtype == torch.float32 and not k_read[0].any()  # position 0: never written
    assert torch.equal(k_read[1:], stored * 0.5)  # exactly the stored values times the scale
    torch.testing.assert_close(v_read[1:], v, rtol=2**-4, atol=4 * 2**-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_layer_program_writes_its_step_k_v_into_its_pools_in_place(dtype):
    """A decode layer program stores its K/V in the pools it was given, at its slots, as
    `KVCache.write` stores the same tensors (an fp8 layer quantised with that layer's scales),
    and touches nothing else."""
    kv_name = {torch.bfloat16: "auto", **{v: k for k, v in FP8.items()}}[dtype]
    config = tiny_config(dtype="bfloat16", kv_cache_dtype=kv_name)
    arch = tiny_arch()
    key = next(k for k in all_program_keys(config) if k.kind is ProgramKind.DECODE)
    scales = [(0.5 + i, 4.0 / (i + 1)) for i in range(arch.num_layers)]
    program, host = (
        KVCache(arch, num_blocks=8, block_size=16, dtype=dtype, scales=scales) for _ in range(2)
    )
    args = example_args(key, arch, config)
    g = torch.Generator().manual_seed(0)

    def rand(t: torch.Tensor) -> torch.Tensor:  # the hidden state and weights: not all zeros
        return torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t

    slots = torch.tensor([17, 34, 0, 0][: key.size])  # block 1 pos 1, block 2 pos 2, the dummy
    layer = 1
    cache = program.layer(layer)
    args = args._replace(
        hidden=rand(args.hidden),
        k_pool=cache.k,
        v_pool=cache.v,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        step=args.step._replace(slots=slots),
        weights=tuple(rand(w) for w in args.weights),
    )
    with torch.no_grad():
        _, k_new, v_new = build_module(key, arch, config)(*flatten(args))
    host.write(layer, slots, k_new, v_new)
    for a, b in zip(program.k + program.v, host.k + host.v, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert program.k[layer].view(torch.uint8)[1, 1].any()  # slot 17: written
    assert not program.k[0].view(torch.uint8).any()  # another layer's pools: untouched


@pytest.fixture(scope="module")
def scaled_model_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama with vLLM-style per-layer KV scales in its checkpoint."""
    out = tmp_path_factory.mktemp("tiny-kv-scales") / "model"
    shutil.copytree(tiny_model_dirs("llama"), out)
    (path,) = out.glob("*.safetensors")
    tensors = load_file(path)
    for layer in range(load_arch(out).num_layers):
        prefix = f"model.layers.{layer}.self_attn."
        tensors[prefix + "k_scale"] = torch.tensor(0.25 * (layer + 1))
        tensors[prefix + "v_scale"] = torch.tensor([0.125])  # [1] as some checkpoints store it
    save_file(tensors, path, metadata={"format": "pt"})
    return out


def test_checkpoint_kv_scales_are_read_and_used_by_fp8_pools(scaled_model_dir, tmp_path):
    arch = load_arch(scaled_model_dir)
    weights = load_weights(scaled_model_dir, arch, torch.float32)
    assert weights.kv_scales == ((0.25, 0.125), (0.5, 0.125))
    model, _ = load_model(scaled_model_dir, tiny_config(kv_cache_dtype="fp8"), show_progress=False)
    assert [float(s) for s in model.kv.k_scale] == [0.25, 0.5]
    auto, _ = load_model(scaled_model_dir, tiny_config(), show_progress=False)
    assert [float(s) for s in auto.kv.k_scale] == [1.0, 1.0]  # model-dtype pools ignore them
    partial = tmp_path / "partial"
    shutil.copytree(scaled_model_dir, partial)
    (path,) = partial.glob("*.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing for some layers: model\.layers\.1"):
        load_weights(partial, arch, torch.float32)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs) -> HFReference:
    return HFReference(tiny_model_dirs("llama"))


@pytest.fixture(scope="module")
def sequences(reference):
    """Three chat prompts, each followed by 24 HF greedy tokens (prefill, then decode)."""
    prompts = chat_prompt_token_ids(reference.model_dir)[:3]
    return prompts, [p + reference.greedy(p, 24) for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_kv_logits_stay_within_the_documented_tolerance(reference, sequences, kv_cache_dtype):
    """Teacher-forced logits (prompt positions from prefill programs reading chunks, the rest
    from decode programs) against HF float32, under the FP8 KV tolerances."""
    prompts, full = sequences
    config = tiny_config(kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32)
    model, _ = load_model(reference.model_dir, config, show_progress=False)
    report = validate(
        reference.model_dir,
        model,
        full,
        prompt_lengths=[len(p) for p in prompts],
        three_way=False,
        reference=reference,
    )
    assert report.slices[0].tolerance == default_tolerances(kv_cache_dtype)[5]
    assert report.passed, report.format_summary()
    assert model.kv.k[0].dtype == FP8[kv_cache_dtype]


@pytest.mark.slow  # compiles fp8 programs; the kernels' fp8 tests and validate cover the fast suite
def test_fp8_kv_compiled_programs_equal_the_eager_ones(tiny_model_dir):
    """One compiled configuration (Inductor, the decode kernel over fp8 pools) against eager."""
    buckets = dict(
        decode_batch_buckets=(4,),
        decode_context_buckets=(256,),
        prefill_token_buckets=(64,),
        prefill_context_buckets=(256,),
    )
    prompts = [[(97 * i + 13 * n) % 40000 + 100 for i in range(n)] for n in (5, 40, 90)]
    outputs = {}
    for backend in ("inductor", "eager"):
        config = tiny_config(kv_cache_dtype="fp8_e4m3", backend=backend, **buckets)
        model, _ = load_model(tiny_model_dir, config, show_progress=False)
        requests = [GenerationRequest(p, max_tokens=10) for p in prompts]
        outputs[backend] = Generator(model).generate(requests)
    for compiled, eager in zip(outputs["inductor"], outputs["eager"], strict=True):
        assert compiled.token_ids == eager.token_ids
        assert compiled.logprobs == pytest.approx(eager.logprobs, abs=1e-3)


TINY_CLI_CONFIG = ["--backend=eager", "--dtype=float32", "--batch-size=4", "--max-model-len=256",
                   "--max-num-batched-tokens=64", "--num-tokens=8"]  # fmt: skip


def test_validate_and_kv_commands_measure_the_fp8_cache(tiny_model_dirs, capsys):
    model_dir = str(tiny_model_dirs("llama"))
    args = [model_dir, *TINY_CLI_CONFIG, "--kv-cache-dtype=fp8"]
    assert main(["validate", *args]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the console's line wrapping
    assert "KV cache fp8_e4m3 (its tolerances)" in out and "PASSED" in out
    assert main(["tensors", "kv", *args]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no block beyond 0.1" in out  # the e4m3 rounding, within its tolerance


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm_validates_with_an_fp8_kv_cache(default_model_dir, dtype):
    """The measurement behind FP8_KV_TOLERANCES, through the command a user runs."""
    command = ["validate", str(default_model_dir), "--backend=eager", f"--dtype={dtype}",
               "--batch-size=8", "--max-model-len=512", "--max-num-batched-tokens=128",
               "--kv-cache-dtype=fp8"]  # fmt: skip
    result = run_vllm_aot(*command, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
