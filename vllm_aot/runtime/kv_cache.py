"""The paged KV cache: per-layer block pools, a reserved dummy block, and a block allocator.

Block 0 is the dummy: padded tokens write their K/V there and padded block-table entries point
there, so padding never touches a live block. Slot-per-sequence (optimum-neuron's layout) is the
case `block_size == max_model_len`: one block per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_aot.models.config import ModelArch
from vllm_aot.models.layers import FP8_KV_DTYPES, PagedKV, dequantize_kv, write_kv

DUMMY_BLOCK = 0


class KVCache:
    """K and V pools, one pair per layer: [num_blocks, block_size, kv_heads, head_dim] of `dtype`
    (the model's, or an fp8 type), with each layer's float32 scales (`models.layers`: an fp8
    pool stores value / scale; `scales` [layer] = (k_scale, v_scale), default 1.0; pools of
    other dtypes ignore them). A layer's pools are views of one tensor per K and V
    [layers, ...]; each layer program writes its own step's K/V into them in place."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        scales: Sequence[tuple[float, float]] = (),
    ) -> None:
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # Zeroed: never-written slots must hold finite values, because masked attention
        # multiplies them by zero and NaN * 0 is NaN.
        k_all, v_all = (torch.zeros((arch.num_layers, *shape), dtype=dtype) for _ in range(2))
        self.k, self.v = list(k_all.unbind(0)), list(v_all.unbind(0))
        is_fp8 = dtype in FP8_KV_DTYPES
        if not is_fp8 or not scales:
            scales = [(1.0, 1.0)] * arch.num_layers
        assert len(scales) == arch.num_layers, f"{len(scales)} KV scales, {arch.num_layers} layers"
        self.k_scale = [torch.tensor(k, dtype=torch.float32) for k, _ in scales]
        self.v_scale = [torch.tensor(v, dtype=torch.float32) for _, v in scales]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # Built once: the pools are written in place, never replaced.
        pairs = zip(self.k, self.v, self.k_scale, self.v_scale, strict=True)
        self._layers = [PagedKV(*layer) for layer in pairs]

    def layer(self, layer: int) -> PagedKV:
        """What a layer program reads: the layer's pools and scales."""
        return self._layers[layer]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> None:
        """Store one layer's keys/values outside its program (a tap's replacements): slot_mapping
        [tokens]; k_new, v_new [tokens, kv, d]. Layer programs write their own (`write_kv`)."""
        write_kv(self._layers[layer], slot_mapping, k_new, v_new)

    def gather(self, layer: int, block_table: Sequence[int], num_tokens: int):
        """One sequence's K and V, [num_tokens, kv_heads, head_dim] each (for analysis/tests);
        an fp8 pool's dequantised to float32."""
        blocks = torch.as_tensor(list(block_table), dtype=torch.int64)
        cache = self.layer(layer)
        k = dequantize_kv(cache.k[blocks], cache.k_scale, torch.float32)
        v = dequantize_kv(cache.v[blocks], cache.v_scale, torch.float32)
        return k.flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens]


class BlockAllocator:
    """O(1) free list over blocks 1..num_blocks-1 (block 0 is the dummy)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "need at least the dummy block and one real block"
        self._free = list(range(num_blocks - 1, DUMMY_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"need {count} KV blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, blocks: Sequence[int]) -> None:
        assert DUMMY_BLOCK not in blocks, "the dummy block is never allocated"
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
