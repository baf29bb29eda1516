"""Weight formats (registration contract, kernel choice per CPU, numerics) and shards (each rank's
slice recombines to the unsharded linear), without a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_aot import kernels
from vllm_aot.models.formats import (
    ATEN,
    LINEAR_BF16,
    QUANTIZED_KERNELS,
    WEIGHT_FORMATS,
    dense_format,
    weight_format,
)
from vllm_aot.models.linear import (
    SINGLE_RANK,
    CpuFeatures,
    Linear,
    Rank,
    Shard,
    gather_outputs,
    shard_bias,
    shard_input,
    shard_weight,
)

pytestmark = pytest.mark.unit

AVX2_ONLY = CpuFeatures(can_use_kernels=True, has_native_bf16=False)
NATIVE_BF16 = CpuFeatures(can_use_kernels=True, has_native_bf16=True)
KERNELS_OFF = CpuFeatures(can_use_kernels=False, has_native_bf16=False)


@pytest.mark.parametrize(
    ("fmt", "cpu", "kernel"),
    [
        ("bf16", AVX2_ONLY, LINEAR_BF16),  # aten's bfloat16 matmul is 5-10x slower there
        ("bf16", NATIVE_BF16, ATEN),
        ("bf16", KERNELS_OFF, ATEN),  # VLLM_AOT_KERNELS=0 or not x86-64 AVX2
        ("fp32", AVX2_ONLY, ATEN),
        ("fp32", NATIVE_BF16, ATEN),
        *(
            (fmt, cpu, QUANTIZED_KERNELS[fmt])
            for fmt in QUANTIZED_KERNELS
            for cpu in (AVX2_ONLY, NATIVE_BF16)
        ),
        *((fmt, KERNELS_OFF, f"torch.dequantize/{fmt}") for fmt in QUANTIZED_KERNELS),
    ],
)
def test_kernel_choice_follows_the_cpu(fmt, cpu, kernel):
    assert WEIGHT_FORMATS[fmt].kernel(cpu).name == kernel


def test_program_kernels_name_each_format_the_attention_the_experts_and_the_head(
    monkeypatch,
):
    """The cache key's kernel names: bf16 kernel only without native bfloat16, else aten."""
    for fmt in ("fp32", "bf16"):
        cpu = torch.cpu
        native = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
        uses_kernel = fmt == "bf16" and kernels.kernels_enabled() and not native
        assert kernels.program_kernels([fmt]) == {
            f"linear.{fmt}": LINEAR_BF16 if uses_kernel else ATEN,
            "attention": kernels.DECODE_ATTENTION if kernels.kernels_enabled() else kernels.TORCH,
            "prefill_attention": (
                kernels.PREFILL_ATTENTION if kernels.kernels_enabled() else kernels.TORCH
            ),
            "experts": kernels.MOE_EXPERTS if kernels.kernels_enabled() else kernels.TORCH,
            "logprobs": kernels.LOGPROB_STATS if kernels.kernels_enabled() else kernels.TORCH,
            "sampling": kernels.SAMPLE_TOKENS if kernels.kernels_enabled() else kernels.TORCH,
        }
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    expected = LINEAR_BF16 if kernels.kernels_enabled() else ATEN
    assert kernels.program_kernels(["bf16", "q4_1"])["linear.bf16"] == expected


@pytest.mark.parametrize("name", sorted(WEIGHT_FORMATS))
def test_every_format_prepares_what_its_example_declares(name):
    fmt = WEIGHT_FORMATS[name]
    assert fmt.name == name and weight_format(name) is fmt
    prepared = fmt.prepare(torch.randn(24, 256))  # whole super-blocks of the K-quants
    example = fmt.example(24, 256)
    assert len(prepared) == len(example) == len(fmt.tensor_names)
    assert [(t.shape, t.dtype) for t in prepared] == [(t.shape, t.dtype) for t in example]
    assert all(t.is_contiguous() for t in prepared)


def usable_kernels(name: str) -> list:
    """The format's kernels this machine can run (ours only where they build)."""
    cpus = [KERNELS_OFF] + ([AVX2_ONLY, NATIVE_BF16] if kernels.kernels_enabled() else [])
    found = {
        WEIGHT_FORMATS[name].kernel(cpu).name: WEIGHT_FORMATS[name].kernel(cpu) for cpu in cpus
    }
    if any(k.name != ATEN for k in found.values()):
        kernels.load()
    return list(found.values())


@pytest.mark.parametrize("name", sorted(WEIGHT_FORMATS))
def test_every_format_multiplies_like_the_float_linear(name):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 256, generator=g), torch.randn(5, 256, generator=g)
    b = torch.randn(48, generator=g)
    fmt = WEIGHT_FORMATS[name]
    stored = fmt.prepare(w)
    x = x.to(stored[0].dtype) if stored[0].is_floating_point() else x
    want = F.linear(x.float(), fmt.dequantize(*stored), b)
    for kernel in usable_kernels(name):
        got = kernel.apply(x, *stored, b.to(x.dtype)).float()
        # Sums in another order: float32 rounding of the largest output's size. bfloat16 keeps 8
        # bits of mantissa: relative error ~2^-8 per product, summed over 64.
        scale = want.abs().max().item()
        tol = 1e-5 * scale if x.dtype == torch.float32 else 5e-2 * scale
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=kernel.name)


def test_unknown_format_names_the_supported_ones():
    with pytest.raises(ValueError, match="'q3_k' is not supported; supported: fp32, bf16, int8"):
        weight_format("q3_k")
    assert dense_format(torch.bfloat16).name == "bf16"


# --- shards ------------------------------------------------------------------------------------


def fused_qkv(shard: Shard, has_bias: bool = True) -> Linear:
    """q of 8 heads, k and v of 4 (head_dim 2), over 12 input features."""
    return Linear(
        name="qkv_proj",
        in_features=12,
        out_parts=(16, 8, 8),
        sources=("q", "k", "v"),
        format="fp32",
        shard=shard,
        has_bias=has_bias,
    )


@pytest.mark.parametrize("shard", list(Shard))
@pytest.mark.parametrize("size", [1, 2, 4])
def test_rank_outputs_recombine_into_the_unsharded_linear(shard, size):
    linear = fused_qkv(shard)
    g = torch.Generator().manual_seed(size)
    w = torch.randn(linear.out_features, linear.in_features, generator=g)
    b, x = torch.randn(linear.out_features, generator=g), torch.randn(3, 12, generator=g)
    outputs = []
    for index in range(size):
        rank = Rank(index, size)
        w_r, b_r = shard_weight(linear, w, rank), shard_bias(linear, b, rank)
        outputs.append(F.linear(shard_input(linear, x, rank), w_r, b_r))
    full = F.linear(x, w, b)
    torch.testing.assert_close(gather_outputs(linear, outputs), full, rtol=1e-5, atol=1e-5)


def test_column_shard_gives_each_rank_its_heads_of_q_k_and_v():
    linear = fused_qkv(Shard.COLUMN)
    w = torch.arange(32.0)[:, None].expand(32, 12)  # row i holds i
    rows = shard_weight(linear, w, Rank(1, 2))[:, 0].tolist()
    assert rows == list(range(8, 16)) + list(range(20, 24)) + list(range(28, 32))


def test_row_shard_splits_inputs_and_keeps_the_bias_on_rank_zero():
    linear = Linear("o_proj", 8, (6,), ("o_proj",), "fp32", Shard.ROW, has_bias=True)
    w, b = torch.randn(6, 8), torch.randn(6)
    assert torch.equal(shard_weight(linear, w, Rank(1, 2)), w[:, 4:])
    assert torch.equal(shard_bias(linear, b, Rank(0, 2)), b)
    assert not shard_bias(linear, b, Rank(1, 2)).any()


def test_vocab_shard_pads_the_last_range_with_zero_rows():
    linear = Linear("lm_head", 4, (10,), ("lm_head",), "fp32", Shard.VOCAB)
    w = torch.arange(1.0, 11.0)[:, None].expand(10, 4)
    parts = [shard_weight(linear, w, Rank(i, 4))[:, 0].tolist() for i in range(4)]
    assert parts == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 0]]


def test_uneven_splits_are_refused_naming_the_sizes():
    linear = fused_qkv(Shard.COLUMN)
    w = torch.zeros(32, 12)
    with pytest.raises(ValueError, match=r"qkv_proj output features \(16\) .* over 3 ranks"):
        shard_weight(linear, w, Rank(0, 3))
    with pytest.raises(ValueError, match=r"input features \(12\) .* over 5 ranks"):
        shard_weight(fused_qkv(Shard.ROW), w, Rank(0, 5))


@pytest.mark.parametrize("shard", list(Shard))
def test_one_rank_holds_the_whole_weight(shard):
    linear = fused_qkv(shard)
    w, b = torch.randn(32, 12), torch.randn(32)
    assert torch.equal(shard_weight(linear, w, SINGLE_RANK), w)
    assert torch.equal(shard_bias(linear, b, SINGLE_RANK), b)
