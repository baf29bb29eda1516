"""Our CPU kernels against their pure-torch references, on the shapes programs give them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import attention_inputs, needs_kernels
from vllm_aot import kernels
from vllm_aot.models.formats import ATEN, LINEAR_BF16, WEIGHT_FORMATS
from vllm_aot.models.layers import PagedKV, decode_attention, verify_attention
from vllm_aot.models.linear import CpuFeatures
from vllm_aot.runtime.sampler import logprob_stats

pytestmark = [pytest.mark.unit, needs_kernels]


@pytest.fixture(scope="module", autouse=True)
def loaded():
    kernels.load()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33, 130])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (7, 21), (13, 40)])
def test_linear_bf16_matches_float32_product(rows, n, k):
    """Every activation-row path (1-2 rows read in registers, blocks of 3, tails) and weight-row
    tails (N not a multiple of the tile) and K tails (not a multiple of 8 or 16)."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    got = torch.ops.vllm_aot.linear_bf16(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = F.linear(x.float(), w.float())
    # float32 sums in a different order, then one rounding to bfloat16 (8 bits of mantissa).
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_linear_keeps_leading_dimensions_and_adds_bias():
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    b = torch.randn(16).bfloat16()
    avx2_only = CpuFeatures(can_use_kernels=True, has_native_bf16=False)
    kernel = WEIGHT_FORMATS["bf16"].kernel(avx2_only)
    assert kernel.name == LINEAR_BF16
    got = kernel.apply(x, w, b)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2e-2, atol=5e-2)


def decode_attention_case(dtype, pool_dtype, scales=(1.0, 1.0), heads=9, kv_heads=3, dim=64):
    """Rows with no context (padding rows), part of a block, exactly a block, several blocks and
    the whole bucket; block tables in any order, with dummy entries past each row's length.
    Returns (q, k_new, v_new, cache, block tables, context mask)."""
    g = torch.Generator().manual_seed(0)
    rows, block, blocks, width = 6, 16, 40, 8
    q, k_new, v_new, cache = attention_inputs(
        g, rows, (heads, kv_heads, dim), (blocks, block), dtype, pool_dtype, scales
    )
    lengths = torch.tensor([0, 1, 15, 16, 70, width * block])
    tables = torch.randint(1, blocks, (rows, width), generator=g)
    tables[torch.arange(width)[None] * block >= lengths[:, None]] = 0  # the dummy block
    mask = torch.arange(width * block)[None] < lengths[:, None]
    return q, k_new, v_new, cache, tables, mask


# (query heads, KV heads, head size): SmolLM2's, the other group sizes the kernel has a register
# path for (1, 2, 4 query heads a KV head; heads of 128), a group taken 4 then 3 at a time
# (Qwen2-0.5B's 7), and a head size it has none for.
ATTENTION_SHAPES = [(9, 3, 64), (4, 4, 64), (8, 4, 128), (8, 2, 64), (14, 2, 64), (8, 1, 32)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_reference(dtype, shape):
    heads, kv_heads, dim = shape
    case = decode_attention_case(dtype, dtype, heads=heads, kv_heads=kv_heads, dim=dim)
    want = decode_attention(*case)
    got = kernels.decode_attention_fn(kernels.DECODE_ATTENTION)(*case)
    assert got.dtype == dtype and got.shape == want.shape == (6, heads * dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 1, 32)])
@pytest.mark.parametrize("pool_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_attention_kernel_matches_reference(dtype, pool_dtype, shape):
    """A verify step's 5 tokens a row (the newest and 4 drafts): each sees its row's context
    and the row's new keys up to its own, as the SDPA reference does."""
    heads, kv_heads, dim = shape
    pool, scales = (dtype, (1.0, 1.0)) if pool_dtype is None else (pool_dtype, (0.5, 2.0))
    q, k_new, v_new, cache, tables, mask = decode_attention_case(
        dtype, pool, scales, heads=heads, kv_heads=kv_heads, dim=dim
    )
    g = torch.Generator().manual_seed(1)
    n, rows = 5, tables.shape[0]
    q = torch.randn(rows * n, heads, dim, generator=g).to(dtype)
    k_new, v_new = (torch.randn(rows * n, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    case = (q, k_new, v_new, cache, tables, mask)
    want = verify_attention(*case)
    got = kernels.decode_attention_fn(kernels.DECODE_ATTENTION, verify=True)(*case)
    assert got.dtype == dtype and got.shape == want.shape == (rows * n, heads * dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
def test_decode_attention_reads_fp8_pools_as_the_reference(dtype, pool_dtype, scales):
    """Every fp8 byte widened through the kernel's table, the scales applied (folded into the
    query for keys, into the sum for values) as the reference's dequantised pools."""
    case = decode_attention_case(dtype, pool_dtype, scales)
    assert case[3].k.dtype == pool_dtype
    want = decode_attention(*case)
    got = kernels.decode_attention_fn(kernels.DECODE_ATTENTION)(*case)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_finite_fp8_value_reads_back_as_torch_converts_it(pool_dtype):
    """Row i reads one cached value vector holding every finite value of the format, rotated by
    i, beside a zero own value under equal scores: its output is exactly half of it."""
    codes = torch.arange(256, dtype=torch.uint8).view(pool_dtype)
    finite = codes[codes.float().isfinite()]  # [n]
    n, dim = finite.numel(), 64
    rotated = (torch.arange(n)[:, None] + torch.arange(dim)[None]) % n
    v_pool = finite[rotated].view(n, 1, 1, dim)  # one position per block
    one, zeros = torch.ones(()), torch.zeros(n, 1, dim)
    cache = PagedKV(torch.zeros_like(v_pool), v_pool, one, one)
    tables = torch.arange(n)[:, None]
    mask = torch.ones(n, 1, dtype=torch.bool)
    got = kernels.decode_attention_fn(kernels.DECODE_ATTENTION)(
        zeros, zeros, zeros, cache, tables, mask
    )
    assert torch.equal(got, 0.5 * v_pool.float().view(n, dim))


@pytest.mark.parametrize(("rows", "vocab", "n"), [(5, 49152, 20), (3, 1003, 7), (2, 9, 9)])
def test_logprob_stats_kernel_matches_the_samplers_reference(rows, vocab, n):
    """Token logprobs, ranks and the top-n (a vocabulary with a tail past the last eight, n up to
    all of it), against `runtime.sampler.logprob_stats`."""
    g = torch.Generator().manual_seed(rows)
    logits = 8 * torch.randn(rows, vocab, generator=g)
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    tokens[0] = logits[0].argmax()  # rank 1
    kernel = kernels.logprob_stats_kernel(kernels.LOGPROB_STATS)
    got, want = kernel(logits, tokens, n), logprob_stats(logits, tokens, n)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # token logprobs
    assert torch.equal(got[1], want[1]) and got[1][0] == 1  # ranks
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)  # top-n logprobs
    assert torch.equal(got[3], want[3])  # top-n ids, descending


def test_logprob_stats_kernel_keeps_the_lower_id_first_among_equal_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 2.0, 1.0, 3.0, 2.0]])
    kernel = kernels.logprob_stats_kernel(kernels.LOGPROB_STATS)
    _, ranks, top, ids = kernel(logits, torch.tensor([2]), 5)
    assert ids.tolist() == [[1, 3, 4, 8, 2]] and ranks.tolist() == [7]
    torch.testing.assert_close(top[0, :4], torch.log_softmax(logits, -1)[0, [1, 3, 4, 8]])


def test_kernels_off_selects_aten_and_torch(monkeypatch):
    monkeypatch.setenv("VLLM_AOT_KERNELS", "0")
    assert kernels.linear_impl("bf16") == ATEN
    assert kernels.attention_impl() == kernels.TORCH
    assert kernels.prefill_attention_impl() == kernels.TORCH
    assert kernels.logprobs_impl() == kernels.TORCH
    assert kernels.sampling_impl() == kernels.TORCH
    monkeypatch.delenv("VLLM_AOT_KERNELS")
    assert kernels.linear_impl("fp32") == ATEN  # MKL is fast in float32
