"""The shared maths decoder layers are composed from, written for static shapes.

Family files (`models/llama.py`, ...) compose a layer from these: RMSNorm, rotary, head split,
prefill and decode attention over the paged pool, SwiGLU; LayerNorm, packed bidirectional
attention (encoders); a sparse MoE block's routing and its experts (the reference for the
kernel); the linears are the family's
`LayerParams.linear`. Pure functions over tensors: no module state, no data-dependent shapes, so
the same code runs eagerly and exports into an ahead-of-time compiled program. Attention reads
cached keys and values from the paged pool; `write_kv` is the one function with a side effect:
the layer program stores its step's new K/V into its pools in place through the slot mapping
(AOTInductor mutates the input, no copy), before attention, which reads this step's own K/V as
computed and the pool only up to the positions before them.

FP8 KV cache: a pool of `torch.float8_e4m3fn` or `float8_e5m2` stores `value / scale`, saturated
to the format's finite range (`quantize_kv`), with one float32 scale per layer for K and one for
V (1.0, or the checkpoint's); attention reads it as `stored * scale` (`dequantize_kv`). The
step's own new K/V are attended as computed, unquantised. Pools of the model's dtype (scales
1.0) are read as they are: their path has no extra operation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class PagedKV(NamedTuple):
    """One layer's paged cache as attention reads it (layer programs take it as 4 inputs)."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], the KV cache dtype
    v: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    k_scale: torch.Tensor  # [] float32: a stored key is key / k_scale (fp8 pools only)
    v_scale: torch.Tensor  # [] float32


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of `dtype` stores it: fp8 pools x / scale saturated to the finite range."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def write_kv(cache: PagedKV, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """A step's keys and values, [tokens, kv_heads, head_dim], into one layer's pools in place
    at the flat `slots` [tokens] (block * block_size + offset; padding's in the dummy block), as
    the pools store them (`quantize_kv`; an fp8 pool's bytes: aten has no index_copy_ for fp8).
    Layer programs call it, so a step's K/V land inside its programs, with no copy on the host."""
    for pool, new, scale in ((cache.k, k_new, cache.k_scale), (cache.v, v_new, cache.v_scale)):
        stored = quantize_kv(new, scale, pool.dtype)
        if pool.dtype in FP8_KV_DTYPES:
            pool, stored = pool.view(torch.uint8), stored.view(torch.uint8)
        pool.view(-1, *stored.shape[1:]).index_copy_(0, slots, stored)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool elements as `dtype` values: fp8 ones times the scale (in float32), others as they
    are (no copy)."""
    if stored.dtype not in FP8_KV_DTYPES:
        return stored
    return (stored.float() * scale).to(dtype)


class QKV(NamedTuple):
    q: torch.Tensor  # [tokens, heads, head_dim]
    k: torch.Tensor  # [tokens, kv_heads, head_dim]
    v: torch.Tensor  # [tokens, kv_heads, head_dim]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as HF Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_tokens, head_dim] for `positions` [num_tokens], in the model dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim] (half-rotation form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention in fp32.

    q: [rows, kv_heads, group, queries, head_dim]; k, v: [rows, kv_heads, keys, head_dim];
    mask: [rows, 1, 1, queries, keys] bool, True where a key is visible. Every query sees at least
    its own key, so no row is all-masked. Returns [rows, kv_heads, group, queries, head_dim].
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)[:, :, None]) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()[:, :, None])


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    context_mask: torch.Tensor,
) -> torch.Tensor:
    """One query per row against that row's cached blocks plus its own new key.

    q: [rows, heads, head_dim]; k_new, v_new: [rows, kv_heads, head_dim];
    cache: the layer's pools and scales; block_tables: [rows, ctx_blocks];
    context_mask: [rows, ctx_blocks * block_size] (True for cached positions < context length).
    Returns [rows, heads * head_dim] in q's dtype.

    Written as broadcasts and sums rather than batched matmuls: with one query per row the
    products are small, and the compiler fuses the block gather, the widening to fp32, the
    products and the sums into a few loops instead of materialising gathered, concatenated and
    widened copies of K and V for a matmul library.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    num_keys = block_tables.shape[1] * cache.k.shape[1]
    scale = head_dim**-0.5
    qg = q.float().view(rows, 1, num_kv_heads, group, head_dim) * scale
    k_ctx = dequantize_kv(cache.k[block_tables], cache.k_scale, torch.float32)
    v_ctx = dequantize_kv(cache.v[block_tables], cache.v_scale, torch.float32)
    k_ctx = k_ctx.view(rows, num_keys, num_kv_heads, 1, head_dim)
    v_ctx = v_ctx.view(rows, num_keys, num_kv_heads, 1, head_dim)
    scores = (qg * k_ctx.float()).sum(-1)  # [rows, keys, kv, group]
    scores = scores.masked_fill(~context_mask[:, :, None, None], float("-inf"))
    own = (qg[:, 0] * k_new[:, :, None].float()).sum(-1)  # [rows, kv, group]
    probs = torch.softmax(torch.cat([scores, own[:, None]], dim=1), dim=1)
    out = (probs[:, :num_keys, :, :, None] * v_ctx.float()).sum(1)
    out = out + probs[:, num_keys, :, :, None] * v_new[:, :, None].float()
    return out.reshape(rows, num_heads * head_dim).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKV,
    context_block_ids: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Packed tokens of one or more sequences against cached blocks plus the new keys.

    q: [tokens, heads, head_dim]; k_new, v_new: [tokens, kv_heads, head_dim];
    cache: the layer's pools and scales (read dequantised to q's dtype);
    context_block_ids: [ctx_blocks], the cached blocks of every sequence in the step, flattened;
    mask: [tokens, ctx_blocks * block_size + tokens], True where a key is visible to a token
    (same sequence, earlier or same position, not padding). Returns [tokens, heads * head_dim].

    torch's scaled-dot-product attention in float32 whatever the model's dtype, as decode's
    (its CPU flash kernel: blocks of queries and keys with an online softmax, never the whole
    score matrix), faster than `_attend`'s score matrix and, unlike bfloat16, within validate's
    tolerances (docs/benchmarks.md#prefill-attention-in-float32).
    """
    num_tokens, num_heads, head_dim = q.shape
    k_ctx = dequantize_kv(cache.k[context_block_ids], cache.k_scale, k_new.dtype)
    v_ctx = dequantize_kv(cache.v[context_block_ids], cache.v_scale, v_new.dtype)
    k_ctx, v_ctx = k_ctx.flatten(0, 1), v_ctx.flatten(0, 1)  # no blocks: [0, kv, d]
    k = torch.cat([k_ctx, k_new], dim=0).transpose(0, 1)[None]  # [1, kv, keys, d]
    v = torch.cat([v_ctx, v_new], dim=0).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float(),
        v.float(),
        attn_mask=mask,
        scale=head_dim**-0.5,
        enable_gqa=True,
    )  # [1, heads, tokens, d]
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim).to(q.dtype)


def verify_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    context_mask: torch.Tensor,
) -> torch.Tensor:
    """Each row's `n` new tokens (its newest and its drafts) against that row's cached blocks
    and, causally, its own new keys (speculative decoding's verify step).

    q: [rows * n, heads, head_dim], row-major by row then position; k_new, v_new:
    [rows * n, kv_heads, head_dim]; block_tables: [rows, ctx_blocks]; context_mask:
    [rows, ctx_blocks * block_size] (True for cached positions < the row's context length).
    Returns [rows * n, heads * head_dim] in q's dtype. Every query sees its own key, so padded
    rows and positions are never all-masked; what they compute is never read.

    torch's SDPA in float32 with the row as the batch dimension, as prefill's: the query block
    is small (n <= 9), the keys one row's context bucket.
    """
    rows, num_ctx_blocks = block_tables.shape
    n = q.shape[0] // rows
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    num_ctx = num_ctx_blocks * cache.k.shape[1]
    k_ctx = dequantize_kv(cache.k[block_tables], cache.k_scale, k_new.dtype)
    v_ctx = dequantize_kv(cache.v[block_tables], cache.v_scale, v_new.dtype)
    k_ctx = k_ctx.reshape(rows, num_ctx, num_kv_heads, head_dim)
    v_ctx = v_ctx.reshape(rows, num_ctx, num_kv_heads, head_dim)
    k = torch.cat([k_ctx, k_new.view(rows, n, num_kv_heads, head_dim)], dim=1).transpose(1, 2)
    v = torch.cat([v_ctx, v_new.view(rows, n, num_kv_heads, head_dim)], dim=1).transpose(1, 2)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat(
        [context_mask[:, None, :].expand(rows, n, num_ctx), causal.expand(rows, n, n)], dim=-1
    )  # [rows, n, keys]
    out = F.scaled_dot_product_attention(
        q.float().view(rows, n, num_heads, head_dim).transpose(1, 2),
        k.float(),
        v.float(),
        attn_mask=mask[:, None],
        scale=head_dim**-0.5,
        enable_gqa=True,
    )  # [rows, heads, n, d]
    return out.transpose(1, 2).reshape(rows * n, num_heads * head_dim).to(q.dtype)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> QKV:
    """A fused q|k|v projection [tokens, q_size + 2 * kv_size] -> per-head q, k, v."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return QKV(
        q.reshape(-1, num_heads, head_dim),
        k.reshape(-1, num_kv_heads, head_dim),
        v.reshape(-1, num_kv_heads, head_dim),
    )


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate|up projection [tokens, 2 * intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Routing(NamedTuple):
    """Which experts each token goes to, and with what weight (a sparse MoE block's router)."""

    ids: torch.Tensor  # [tokens, top_k] int64 expert ids
    weights: torch.Tensor  # [tokens, top_k] float32


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool) -> Routing:
    """The top-k experts of each token by softmax probability (in float32), as HF's Qwen3-MoE
    and Mixtral routers: their probabilities renormalised to sum to one when `renormalize`.
    router_logits: [tokens, experts]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: torch.Tensor,
) -> torch.Tensor:
    """A rank's experts over the tokens routed to them: sum over a token's routed experts e that
    this rank holds of weight * down_e(silu(gate_e(x)) * up_e(x)); tokens' other experts (held
    by other ranks) add nothing, so the ranks' results are partial sums.

    x: [tokens, hidden]; topk_ids [tokens, top_k] int64 and topk_weights [tokens, top_k] float32
    (`route`); w13: [rank experts, 2 * intermediate, hidden], each expert's gate|up; w2:
    [rank experts, hidden, intermediate]; first_expert: [] int64, the global id of the rank's
    first expert. Returns [tokens, hidden] in x's dtype, accumulated in float32.

    The reference `kernels/moe_experts.cpp` is tested against, and what programs run where our
    kernels do not: static shapes, so every expert of the rank multiplies every token (weight
    zero where not routed), a dense sweep the kernel avoids by gathering each expert's tokens.
    """
    local_ids = topk_ids - first_expert
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        weight = (topk_weights * (local_ids == expert)).sum(-1)  # [tokens]: 0 if not routed
        hidden = swiglu(F.linear(x, w13[expert]))
        out = out + F.linear(hidden, w2[expert]).float() * weight[:, None]
    return out.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension, computed in fp32 and cast back (encoders)."""
    shape = (x.shape[-1],)
    return F.layer_norm(x.float(), shape, weight.float(), bias.float(), eps).to(x.dtype)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Packed tokens of one or more sequences attending over the step's tokens alone (no cache),
    window by window: an encoder's bidirectional attention when `mask` [windows, window, window]
    is True within each sequence (no sequence crosses a window; padding tokens see themselves).
    q, k, v: [tokens, heads, head_dim], tokens = windows * window. Returns [tokens, heads *
    head_dim]; torch's SDPA in float32, as `prefill_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    num_windows, window, _ = mask.shape

    def windows(x: torch.Tensor) -> torch.Tensor:  # [windows, heads, window, head_dim]
        return x.float().view(num_windows, window, num_heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        windows(q), windows(k), windows(v), attn_mask=mask[:, None], scale=head_dim**-0.5
    )
    return out.transpose(1, 2).reshape(num_tokens, num_heads * head_dim).to(q.dtype)
