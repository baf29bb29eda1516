"""Teacher forcing: the same token sequence through HF transformers and through our runtime.

`HFReference` keeps HF models of one directory (one per dtype) and their greedy continuations.
`teacher_forced_logits` feeds sequences through the serving path as a server would run them: each
prompt through prefill programs (`CompiledModel.prefill_logits`, in chunks), then the
continuation one token per step through decode programs (`CompiledModel.decode`), with
sequences joining and leaving one decode batch at different steps. `our_logits` does it for one
sequence (by default through prefill programs only). All return logits [tokens, vocab] float32
where row i predicts token i + 1.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_aot.runtime.config import DTYPES, RuntimeConfig
from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.sampler import GREEDY

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


def our_logits(
    model: CompiledModel, token_ids: TokenIds, *, num_prompt_tokens: int | None = None
) -> torch.Tensor:
    """Our teacher-forced logits, [len(token_ids), vocab] float32: row i predicts token i + 1.

    The first `num_prompt_tokens` tokens (default: all) go through prefill programs in chunks of
    the largest prefill bucket, each chunk reading the earlier ones from the paged KV cache; the
    rest one token per decode step (see `teacher_forced_logits`). Raises ValueError, naming the
    limit, when the sequence cannot be fed under the model's config. Uses KV blocks of the
    model's cache, so it must not run while a Generator on the same model has requests in flight.
    """
    num_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    return teacher_forced_logits(model, [token_ids], [num_prompt])[0]


def check_feedable(config: RuntimeConfig, num_tokens: int, num_prompt_tokens: int) -> None:
    """Raise ValueError, naming the limit, when a sequence of `num_tokens` tokens, the first
    `num_prompt_tokens` of them prefilled, cannot be fed under `config`."""
    if num_tokens == 0:
        raise ValueError("token_ids is empty")
    if num_tokens > config.max_model_len:
        raise ValueError(
            f"{num_tokens} tokens exceed max_model_len ({config.max_model_len}) of the config"
        )
    if not 1 <= num_prompt_tokens <= num_tokens:
        raise ValueError(f"num_prompt_tokens must be in 1..{num_tokens}, got {num_prompt_tokens}")
    chunk_size = max(config.prefill_token_buckets)
    last_start = (num_prompt_tokens - 1) // chunk_size * chunk_size
    num_ctx = blocks_needed(last_start, config.block_size) * config.block_size
    if num_ctx > max(config.prefill_context_buckets):
        raise ValueError(
            f"{num_prompt_tokens} prompt tokens need a last chunk reading {num_ctx} cached "
            f"tokens, more than the largest prefill context bucket "
            f"({max(config.prefill_context_buckets)})"
        )
    # Decode reads at most max_model_len - 1 cached tokens: the largest decode bucket holds them.


@contextmanager
def sequence_blocks(model: CompiledModel, num_tokens: int) -> Iterator[list[int]]:
    """A block table for `num_tokens` tokens from a fresh allocator, freed on exit.

    Raises ValueError, naming the limit, when the sequence cannot be prefilled under the model's
    config.
    """
    check_feedable(model.config, num_tokens, num_tokens)
    allocator = BlockAllocator(model.kv.num_blocks)
    block_table = allocator.allocate(blocks_needed(num_tokens, model.config.block_size))
    try:
        yield block_table
    finally:
        allocator.free(block_table)


def feed_sequence(
    model: CompiledModel, token_ids: TokenIds, block_table: Sequence[int]
) -> torch.Tensor:
    """Teacher-force `token_ids` through `block_table` with prefill programs, chunk by chunk;
    logits as `our_logits`.

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


@dataclass
class _Fed:
    """A sequence being teacher-forced: its prompt waits for prefill, then its rest is decoded."""

    index: int  # in the caller's sequences
    token_ids: TokenIds
    position: int  # of the next token to decode (the prompt's length until it is prefilled)
    block_table: list[int] = field(default_factory=list)  # [blocks for every token]

    @property
    def is_done(self) -> bool:
        return self.position == len(self.token_ids)


def teacher_forced_logits(
    model: CompiledModel, sequences: Sequence[TokenIds], prompt_lengths: Sequence[int]
) -> list[torch.Tensor]:
    """Each sequence's logits as `our_logits`, its first `prompt_lengths[i]` tokens prefilled and
    the rest decoded; one [len(sequence), vocab] float32 tensor per sequence, in order.

    The schedule is a server's with one request arriving per step: while a decode row and the
    KV blocks of the whole sequence are free, the next sequence is admitted and its prompt
    prefilled alone (chunked); then one decode step feeds every admitted sequence with
    continuation left its next teacher-forced token, and a sequence leaves when its last token
    is fed. So sequences join and leave the batch at different steps: decode runs in batch
    buckets from 1 up to the largest with padded rows, and prefills run between decode steps of
    other sequences, as in serving. Row `prompt_lengths[i] - 1` (the first continuation token's
    prediction) comes from the prompt's last prefill chunk, as the first sampled token does in
    serving; every later row from a decode step. Raises ValueError, naming the limit, when a
    sequence cannot be fed. Uses KV blocks of the model's cache (see `our_logits`).
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    config = model.config
    for token_ids, num_prompt in zip(sequences, prompt_lengths, strict=True):
        check_feedable(config, len(token_ids), num_prompt)
    max_rows = max(config.decode_batch_buckets)
    allocator = BlockAllocator(model.kv.num_blocks)
    parts: list[list[torch.Tensor]] = [[] for _ in sequences]
    waiting = deque(
        _Fed(index=i, token_ids=token_ids, position=num_prompt)
        for i, (token_ids, num_prompt) in enumerate(zip(sequences, prompt_lengths, strict=True))
    )
    running: list[_Fed] = []
    with torch.no_grad():
        while waiting or running:
            if waiting and len(running) < max_rows:
                fed = waiting[0]
                num_blocks = blocks_needed(len(fed.token_ids), config.block_size)
                # With nothing running the allocation must succeed (or raise MemoryError).
                if num_blocks <= allocator.num_free or not running:
                    waiting.popleft()
                    fed.block_table = allocator.allocate(num_blocks)
                    prompt = fed.token_ids[: fed.position]
                    parts[fed.index].append(feed_sequence(model, prompt, fed.block_table))
                    running.append(fed)
            decoding = [fed for fed in running if not fed.is_done]
            if decoding:
                for fed, logits in zip(decoding, _decode_step(model, decoding), strict=True):
                    parts[fed.index].append(logits[None])
                    fed.position += 1
            for fed in [fed for fed in running if fed.is_done]:
                running.remove(fed)
                allocator.free(fed.block_table)
    return [torch.cat(p).float() for p in parts]


def _decode_step(model: CompiledModel, decoding: Sequence[_Fed]) -> torch.Tensor:
    """One decode step feeding each sequence its next token; logits [len(decoding), vocab]."""
    rows = [DecodeRow(f.token_ids[f.position], f.position, f.block_table) for f in decoding]
    sampling = [RowSampling(GREEDY, 0, f.position + 1) for f in decoding]
    return model.decode(rows, sampling).logits
