"""The paged KV cache: per-layer block pools, a reserved dummy block, and a block allocator.

Block 0 is the dummy: padded tokens write their K/V there and padded block-table entries point
there, so padding never touches a live block. Slot-per-sequence (optimum-neuron's layout) is the
case `block_size == max_model_len`: one block per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_aot.models.config import ModelArch

DUMMY_BLOCK = 0


class KVCache:
    """K and V pools, one pair per layer: [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(
        self, arch: ModelArch, *, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # Zeroed: never-written slots must hold finite values, because masked attention
        # multiplies them by zero and NaN * 0 is NaN.
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> None:
        """Store this step's keys/values. slot_mapping: [tokens]; k_new, v_new: [tokens, kv, d]."""
        self.k[layer].view(-1, *k_new.shape[1:]).index_copy_(0, slot_mapping, k_new)
        self.v[layer].view(-1, *v_new.shape[1:]).index_copy_(0, slot_mapping, v_new)

    def gather(self, layer: int, block_table: Sequence[int], num_tokens: int):
        """One sequence's K and V, [num_tokens, kv_heads, head_dim] each (for analysis/tests)."""
        blocks = torch.as_tensor(list(block_table), dtype=torch.int64)
        k = self.k[layer][blocks].flatten(0, 1)[:num_tokens]
        v = self.v[layer][blocks].flatten(0, 1)[:num_tokens]
        return k, v


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
