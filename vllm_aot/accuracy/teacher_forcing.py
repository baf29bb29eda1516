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
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_aot.runtime import policy
from vllm_aot.runtime.config import DTYPES, RuntimeConfig
from vllm_aot.runtime.inputs import PrefillChunk, prefill_key
from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
from vllm_aot.runtime.local_scheduler import Scheduler
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.policy import Limits, StepKind
from vllm_aot.runtime.request import RequestState
from vllm_aot.runtime.sampler import GREEDY

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from vllm_aot.accuracy.quantized import Simulation

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

    `simulate` (`accuracy/quantized.py`) turns the checkpoint's weights into the ones our
    configuration holds (int8 quantised at load); every model is simulated but those asked for
    with `original=True` (the three-way baseline).
    """

    def __init__(self, model_dir: str | Path, simulate: Simulation | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.simulate = simulate
        self._models: dict[tuple[torch.dtype, bool], PreTrainedModel] = {}
        self._continuations: dict[tuple[tuple[int, ...], int, torch.dtype], tuple[int, ...]] = {}

    def model(self, dtype: torch.dtype | str = torch.float32, original: bool = False):
        """The HF model in `dtype`, in eval mode (loaded on first use); on our weights unless
        `original`."""
        dtype = _torch_dtype(dtype)
        simulated = self.simulate is not None and not original
        if (dtype, simulated) not in self._models:
            from transformers import AutoModelForCausalLM, GenerationConfig

            from vllm_aot.models.source import transformers_source

            where, how = transformers_source(self.model_dir)  # a .gguf: dequantised
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **how)
            model.eval()
            pad = model.config.pad_token_id
            model.generation_config = GenerationConfig(pad_token_id=0 if pad is None else pad)
            if simulated:
                self.simulate(model)
            self._models[dtype, simulated] = model
        return self._models[dtype, simulated]

    def logits(
        self, token_ids: TokenIds, dtype: torch.dtype | str = torch.float32, original: bool = False
    ) -> torch.Tensor:
        """Teacher-forced logits, [len(token_ids), vocab] float32: row i predicts token i + 1."""
        model = self.model(dtype, original)
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
    chunk_size = config.max_num_batched_tokens
    last_start = (num_prompt_tokens - 1) // chunk_size * chunk_size
    last_chunk = PrefillChunk(range(last_start, num_prompt_tokens), last_start, ())
    if prefill_key([last_chunk], config) is None:
        raise ValueError(
            f"the last chunk of {num_prompt_tokens} prompt tokens, reading {last_start} cached "
            f"tokens, fits no prefill program (largest context bucket: "
            f"{max(config.prefill_context_buckets)} tokens)"
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
    """Teacher-force `token_ids` through `block_table` with prefill programs, chunk by chunk
    (the policy's chunks); logits as `our_logits`.

    The sequence's K/V stay in the pool afterwards (for KV analysis) until the blocks are reused.
    """
    state = _forced_state("0", token_ids, len(token_ids))
    state.block_table = list(block_table)
    limits = Limits.of(model.config, model.kv.num_blocks)
    parts = []
    with torch.no_grad():
        while policy.is_prefilling(state):
            parts.append(_prefill_step(model, state, limits))
    return torch.cat(parts).float()


def _forced_state(req_id: str, token_ids: TokenIds, num_prompt: int) -> RequestState:
    """A sequence as a request: its prompt, then its continuation fed as if generated.

    It generates one token more than the continuation holds: the prediction after the last
    token, the final logits row (the token itself is never fed)."""
    return RequestState(
        req_id=req_id,
        prompt_token_ids=list(token_ids[:num_prompt]),
        max_tokens=len(token_ids) - num_prompt + 1,
        sampling=GREEDY,
        seed=0,
    )


def _prefill_step(model: CompiledModel, state: RequestState, limits: Limits) -> torch.Tensor:
    """The state's next prefill chunk; logits at its positions, [chunk tokens, vocab]."""
    positions = policy.next_chunk(state, limits)
    logits = model.prefill_logits(state.prefill_chunk(positions))
    state.num_computed_tokens = positions.stop
    return logits


def _decode_step(model: CompiledModel, states: Sequence[RequestState]) -> torch.Tensor:
    """One decode step feeding each state its newest token; logits [len(states), vocab]."""
    rows = [s.decode_row() for s in states]
    sampling = [s.row_sampling(s.num_tokens) for s in states]
    logits = model.decode(rows, sampling).logits
    for state in states:
        state.num_computed_tokens += 1
    return logits


def teacher_forced_logits(
    model: CompiledModel, sequences: Sequence[TokenIds], prompt_lengths: Sequence[int]
) -> list[torch.Tensor]:
    """Each sequence's logits as `our_logits`, its first `prompt_lengths[i]` tokens prefilled and
    the rest decoded; one [len(sequence), vocab] float32 tensor per sequence, in order.

    Steps follow the serving policy (`runtime/policy.py`) with one sequence arriving at a time:
    the first at once, each next one after a decode step once the one before was released (or
    when nothing runs). A released prompt is prefilled alone, chunk by chunk; every decode step
    feeds each running sequence its next teacher-forced token; a sequence leaves when its last
    token is fed. So sequences join and leave the batch at different steps: decode runs in batch
    buckets from 1 up to the largest with padded rows, and prefills run between decode steps of
    other sequences, as in serving. Row `prompt_lengths[i] - 1` (the first continuation token's
    prediction) comes from the prompt's last prefill chunk, as the first sampled token does in
    serving; every later row from a decode step. Raises ValueError, naming the limit, when a
    sequence cannot be fed. Uses KV blocks of the model's cache (see `our_logits`).
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for token_ids, num_prompt in zip(sequences, prompt_lengths, strict=True):
        check_feedable(model.config, len(token_ids), num_prompt)
    arrivals = deque(
        _forced_state(str(i), token_ids, num_prompt)
        for i, (token_ids, num_prompt) in enumerate(zip(sequences, prompt_lengths, strict=True))
    )
    parts: list[list[torch.Tensor]] = [[] for _ in sequences]
    scheduler = Scheduler(
        Limits.of(model.config, model.kv.num_blocks), BlockAllocator(model.kv.num_blocks)
    )
    last = None
    with torch.no_grad():
        while arrivals or scheduler.has_requests:
            # The next sequence arrives once the one before was released and a decode step ran
            # (or nothing runs): at most one joins the batch between two decode steps.
            has_turn = last is StepKind.DECODE or not scheduler.running
            if arrivals and not scheduler.waiting and has_turn:
                scheduler.add(arrivals.popleft())
            step = scheduler.schedule()
            for state, logits in _run(model, step, scheduler.limits):
                token_ids = sequences[int(state.req_id)]
                parts[int(state.req_id)].append(logits)
                # The teacher-forced token takes the place of a sampled one.
                if state.num_computed_tokens == state.num_tokens < len(token_ids):
                    state.output_token_ids.append(token_ids[state.num_tokens])
            scheduler.finish(
                s
                for s in scheduler.running
                if s.num_computed_tokens == len(sequences[int(s.req_id)])
            )
            last = step.kind
    return [torch.cat(p).float() for p in parts]


def _run(
    model: CompiledModel, step: policy.Step[RequestState], limits: Limits
) -> list[tuple[RequestState, torch.Tensor]]:
    """Run one step; each fed request with its logits, [tokens fed, vocab]."""
    if step.kind is StepKind.DECODE:
        logits = _decode_step(model, step.requests)
        return [(state, logits[i : i + 1]) for i, state in enumerate(step.requests)]
    (state,) = step.requests
    return [(state, _prefill_step(model, state, limits))]
