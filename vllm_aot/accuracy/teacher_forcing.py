"""Teacher forcing: the same token sequence through HF transformers and through our runtime.

`HFReference` keeps HF models of one directory (one per dtype) and their greedy continuations;
`our_logits` feeds a sequence through the serving path (`CompiledModel.prefill_logits`) in
chunks. Both return logits [tokens, vocab] float32 where row i predicts token i + 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_aot.runtime.config import DTYPES
from vllm_aot.runtime.inputs import PrefillChunk
from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
from vllm_aot.runtime.model import CompiledModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TokenIds = Sequence[int]


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {list(DTYPES)}")
    return DTYPES[dtype]


class HFReference:
    """HF transformers models of one directory, each dtype loaded once and kept for reuse.

    The models are private copies: their generation config is replaced by a neutral one (no
    repetition penalty or other logits processors), so `greedy` is plain argmax decoding. Greedy
    continuations are remembered too (HF generation is the slow part of a validation run).
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._models: dict[torch.dtype, PreTrainedModel] = {}
        self._continuations: dict[tuple[tuple[int, ...], int, torch.dtype], tuple[int, ...]] = {}

    def model(self, dtype: torch.dtype | str = torch.float32) -> PreTrainedModel:
        """The HF model in `dtype`, in eval mode (loaded on first use)."""
        dtype = _torch_dtype(dtype)
        if dtype not in self._models:
            from transformers import AutoModelForCausalLM, GenerationConfig

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
            model.eval()
            pad = model.config.pad_token_id
            model.generation_config = GenerationConfig(pad_token_id=0 if pad is None else pad)
            self._models[dtype] = model
        return self._models[dtype]

    def logits(self, token_ids: TokenIds, dtype: torch.dtype | str = torch.float32) -> torch.Tensor:
        """Teacher-forced logits, [len(token_ids), vocab] float32: row i predicts token i + 1."""
        model = self.model(dtype)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(token_ids)]), use_cache=False)
        return out.logits[0].float()

    def key_values(
        self, token_ids: TokenIds, dtype: torch.dtype | str = torch.float32
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of HF's cache after `token_ids`, each [tokens, kv_heads, head_dim]
        float32. Post-rotary, as HF applies the rotation before it updates the cache (ours too)."""
        model = self.model(dtype)
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(token_ids)]), use_cache=True)
        return cache_key_values(out.past_key_values)

    def greedy(
        self, prompt_token_ids: TokenIds, num_tokens: int, dtype: torch.dtype | str = torch.float32
    ) -> list[int]:
        """Exactly `num_tokens` argmax tokens after the prompt (EOS does not stop generation)."""
        dtype = _torch_dtype(dtype)
        key = (tuple(prompt_token_ids), num_tokens, dtype)
        if key not in self._continuations:
            self._continuations[key] = tuple(self._generate(prompt_token_ids, num_tokens, dtype))
        return list(self._continuations[key])

    def _generate(
        self, prompt_token_ids: TokenIds, num_tokens: int, dtype: torch.dtype
    ) -> list[int]:
        model = self.model(dtype)
        prompt = torch.tensor([list(prompt_token_ids)])
        with torch.inference_mode():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=num_tokens,
                eos_token_id=None,
            )
        generated = [int(t) for t in out[0, prompt.shape[1] :]]
        if len(generated) != num_tokens:
            raise RuntimeError(
                f"HF generate returned {len(generated)} tokens, asked for {num_tokens}"
            )
        return generated


def cache_key_values(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An HF cache of one sequence -> per layer (K, V), [tokens, kv_heads, head_dim] float32."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    return [(k[0].transpose(0, 1).float(), v[0].transpose(0, 1).float()) for k, v in pairs]


def reference_logits(
    model_dir: str | Path, token_ids: TokenIds, dtype: torch.dtype | str = torch.float32
) -> torch.Tensor:
    """HF transformers' teacher-forced logits, [len(token_ids), vocab] float32.

    Loads the model for this call only; keep an `HFReference` to reuse it across calls.
    """
    return HFReference(model_dir).logits(token_ids, dtype)


def our_logits(model: CompiledModel, token_ids: TokenIds) -> torch.Tensor:
    """Our teacher-forced logits, [len(token_ids), vocab] float32: row i predicts token i + 1.

    Runs the serving path (`prefill_logits`), in chunks of the largest prefill bucket, each chunk
    reading the earlier ones from the paged KV cache. Raises ValueError, naming the limit, when
    the sequence cannot be fed under the model's config. Uses KV blocks of the model's cache, so
    it must not run while a Generator on the same model has requests in flight.
    """
    with sequence_blocks(model, len(token_ids)) as block_table:
        return feed_sequence(model, token_ids, block_table)


@contextmanager
def sequence_blocks(model: CompiledModel, num_tokens: int) -> Iterator[list[int]]:
    """A block table for `num_tokens` tokens from a fresh allocator, freed on exit.

    Raises ValueError, naming the limit, when the sequence cannot be fed under the model's config.
    """
    config = model.config
    if num_tokens == 0:
        raise ValueError("token_ids is empty")
    if num_tokens > config.max_model_len:
        raise ValueError(
            f"{num_tokens} tokens exceed max_model_len ({config.max_model_len}) of the config"
        )
    chunk_size = max(config.prefill_token_buckets)
    last_start = (num_tokens - 1) // chunk_size * chunk_size
    num_ctx = blocks_needed(last_start, config.block_size) * config.block_size
    if num_ctx > max(config.prefill_context_buckets):
        raise ValueError(
            f"{num_tokens} tokens need a last chunk reading {num_ctx} cached tokens, more than "
            f"the largest prefill context bucket ({max(config.prefill_context_buckets)})"
        )
    allocator = BlockAllocator(model.kv.num_blocks)
    block_table = allocator.allocate(blocks_needed(num_tokens, config.block_size))
    try:
        yield block_table
    finally:
        allocator.free(block_table)


def feed_sequence(
    model: CompiledModel, token_ids: TokenIds, block_table: Sequence[int]
) -> torch.Tensor:
    """Teacher-force `token_ids` through `block_table`, chunk by chunk; logits as `our_logits`.

    The sequence's K/V stay in the pool afterwards (for KV analysis) until the blocks are reused.
    """
    chunk_size = max(model.config.prefill_token_buckets)
    with torch.no_grad():
        parts = [
            model.prefill_logits(
                PrefillChunk(list(token_ids[start : start + chunk_size]), start, block_table)
            )
            for start in range(0, len(token_ids), chunk_size)
        ]
    return torch.cat(parts).float()
