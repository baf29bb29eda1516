"""The prefill attention kernel against its reference (`models.layers.prefill_attention`, torch's
SDPA), on the inputs prefill programs get: packed chunks of several sequences, cached contexts
of any length, padding, fp8 pools."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import attention_inputs, needs_kernels
from vllm_aot import kernels
from vllm_aot.models.layers import prefill_attention
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.inputs import PrefillChunk, prepare_prefill
from vllm_aot.runtime.kv_cache import blocks_needed

pytestmark = [pytest.mark.unit, needs_kernels]

BLOCK = 16
CONFIG = RuntimeConfig(
    block_size=BLOCK,
    max_model_len=512,
    max_num_batched_tokens=128,
    prefill_token_buckets=(32, 128),
    prefill_context_buckets=(0, 256, 512),
)


def case(dtype, pool_dtype, chunks_spec, *, scales=(1.0, 1.0), heads=9, kv_heads=3, dim=64):
    """(q, k_new, v_new, cache, context block ids, mask) for chunks of (cached, new) tokens,
    packed by `prepare_prefill` into their bucket (padding tokens and context blocks included);
    each sequence's blocks are scattered over the pool."""
    g = torch.Generator().manual_seed(len(chunks_spec) * 100 + dim)
    num_blocks = 96
    free = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is the dummy
    chunks, used = [], 0
    for cached, new in chunks_spec:
        n = blocks_needed(cached + new, BLOCK)
        table = free[used : used + n].tolist()
        used += n
        chunks.append(PrefillChunk([1] * new, cached, table))
    inputs = prepare_prefill(chunks, CONFIG)
    q, k_new, v_new, cache = attention_inputs(
        g, inputs.key.size, (heads, kv_heads, dim), (num_blocks, BLOCK), dtype, pool_dtype, scales
    )
    return q, k_new, v_new, cache, inputs.context_block_ids, inputs.attn_mask


# (cached, new) tokens per packed sequence: fresh prompts (no context program), one sequence
# with a context ending mid-block, several mixing both, tiles spanning sequences, a bucket
# almost all padding.
PACKINGS = [
    [(0, 100)],
    [(0, 5), (0, 17), (0, 3)],
    [(37, 60)],
    [(16, 20), (0, 9), (200, 33), (5, 1)],
    [(250, 128)],
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packing", PACKINGS)
def test_prefill_attention_kernel_matches_reference(dtype, packing):
    args = case(dtype, dtype, packing)
    want = prefill_attention(*args)
    got = kernels.prefill_attention_fn(kernels.PREFILL_ATTENTION)(*args)
    assert got.dtype == dtype and got.shape == want.shape
    real = sum(new for _, new in packing)  # padding tokens' outputs are never read
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 sums in another order
    torch.testing.assert_close(got[:real].float(), want[:real].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(4, 4, 64), (8, 4, 128), (14, 2, 64), (8, 1, 32), (6, 2, 8)])
def test_prefill_attention_kernel_head_shapes(shape):
    heads, kv_heads, dim = shape
    args = case(
        torch.float32, torch.float32, [(21, 40), (0, 7)], heads=heads, kv_heads=kv_heads, dim=dim
    )
    want = prefill_attention(*args)
    got = kernels.prefill_attention_fn(kernels.PREFILL_ATTENTION)(*args)
    torch.testing.assert_close(got[:47], want[:47], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_prefill_attention_kernel_reads_fp8_pools_as_the_reference(pool_dtype):
    args = case(torch.bfloat16, pool_dtype, [(40, 30), (70, 50)], scales=(0.5, 2.0))
    want = prefill_attention(*args)
    got = kernels.prefill_attention_fn(kernels.PREFILL_ATTENTION)(*args)
    torch.testing.assert_close(got[:80].float(), want[:80].float(), rtol=1e-2, atol=1e-2)


def test_prefill_attention_kernel_refuses_a_mask_of_another_form():
    q, k_new, v_new, cache, ids, mask = case(torch.float32, torch.float32, [(20, 10)])
    mask = mask.clone()
    mask[3, 5] = False  # a hole in token 3's cached keys
    with pytest.raises(RuntimeError, match="token 3 does not see one range"):
        kernels.prefill_attention_fn(kernels.PREFILL_ATTENTION)(q, k_new, v_new, cache, ids, mask)


def test_padding_tokens_see_only_themselves():
    """Padding costs the kernel one key a token, not the square of the padding."""
    *_, mask = case(torch.float32, torch.float32, [(0, 3)])
    assert mask.shape == (32, 32)
    assert mask[3:].sum(-1).tolist() == [1] * 29 and mask[3:, 3:].diagonal().all()
