"""A small continuous-batching generate loop over a CompiledModel (tests, validate, the demo).

Policy, deliberately the one vLLM-Neuron's scheduler enforces: a step is all-prefill or
all-decode; pending prompt tokens go first; a request is admitted only when the KV blocks for its
whole worst case (prompt + max_tokens) are free, so nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.sampler import GREEDY, SamplerOutput, SamplingParams, draw_seed


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    max_tokens: int = 16
    sampling: SamplingParams = GREEDY
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # when requested
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class _Sequence:
    request: GenerationRequest
    result: GenerationResult
    params: SamplingParams  # normalised
    seed: int
    max_len: int  # prompt + the tokens it may generate
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0

    @property
    def num_pending_prompt(self) -> int:
        return len(self.request.prompt_token_ids) - self.num_cached


class Generator:
    def __init__(self, model: CompiledModel, eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.config = model.config
        self.eos_token_ids = tuple(eos_token_ids)
        self.allocator = BlockAllocator(model.kv.num_blocks)

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError, naming the limit, for a request that can never run."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt} tokens leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        for request in requests:
            self.validate(request)
        sequences = [self._new_sequence(r) for r in requests]
        waiting = deque(sequences)
        running: list[_Sequence] = []
        while waiting or running:
            self._admit(waiting, running)
            assert running, "admission must make progress: a request needs more blocks than exist"
            if any(s.num_pending_prompt > 0 for s in running):
                self._prefill_step(running)
            else:
                self._decode_step(running)
            for seq in [s for s in running if s.result.finish_reason]:
                running.remove(seq)
                self.allocator.free(seq.block_table)
        return [s.result for s in sequences]

    def _new_sequence(self, request: GenerationRequest) -> _Sequence:
        return _Sequence(
            request=request,
            result=GenerationResult(list(request.prompt_token_ids)),
            params=request.sampling.normalized(),
            seed=request.sampling.seed if request.sampling.seed is not None else draw_seed(),
            max_len=min(
                len(request.prompt_token_ids) + request.max_tokens, self.config.max_model_len
            ),
            tokens=list(request.prompt_token_ids),
        )

    def _admit(self, waiting: deque[_Sequence], running: list[_Sequence]) -> None:
        while waiting and len(running) < self.config.max_num_seqs:
            # The last sampled token is never written to the cache, hence max_len - 1.
            needed = blocks_needed(waiting[0].max_len - 1, self.config.block_size)
            if needed > self.allocator.num_free:
                return
            seq = waiting.popleft()
            seq.block_table = self.allocator.allocate(needed)
            running.append(seq)

    def _prefill_step(self, running: list[_Sequence]) -> None:
        budget = self.config.max_num_batched_tokens
        ctx_budget = max(self.config.prefill_context_buckets)
        max_rows = max(self.config.head_row_buckets)
        chosen: list[tuple[_Sequence, PrefillChunk]] = []
        for seq in (s for s in running if s.num_pending_prompt > 0):
            ctx = blocks_needed(seq.num_cached, self.config.block_size) * self.config.block_size
            if budget == 0 or ctx > ctx_budget or len(chosen) == max_rows:
                break
            count = min(seq.num_pending_prompt, budget)
            new = seq.request.prompt_token_ids[seq.num_cached : seq.num_cached + count]
            chosen.append((seq, PrefillChunk(list(new), seq.num_cached, seq.block_table)))
            budget -= count
            ctx_budget -= ctx
        sampling = [self._row_sampling(seq, c.num_cached + len(c.token_ids)) for seq, c in chosen]
        out = self.model.prefill([c for _, c in chosen], sampling)
        for row, (seq, chunk) in enumerate(chosen):
            seq.num_cached += len(chunk.token_ids)
            if seq.num_pending_prompt == 0:
                self._append(seq, out, row)

    def _decode_step(self, running: list[_Sequence]) -> None:
        rows = [DecodeRow(s.tokens[-1], len(s.tokens) - 1, s.block_table) for s in running]
        sampling = [self._row_sampling(s, len(s.tokens)) for s in running]
        out = self.model.decode(rows, sampling)
        for row, seq in enumerate(running):
            seq.num_cached += 1
            self._append(seq, out, row)

    @staticmethod
    def _row_sampling(seq: _Sequence, position: int) -> RowSampling:
        return RowSampling(seq.params, seq.seed, position)

    def _append(self, seq: _Sequence, out: SamplerOutput, row: int) -> None:
        token = int(out.tokens[row])
        result = seq.result
        seq.tokens.append(token)
        result.token_ids.append(token)
        result.logprobs.append(float(out.token_logprobs[row]))
        num_top = seq.request.sampling.num_logprobs
        if num_top:
            ids = out.top_ids[row, :num_top].tolist()
            result.top_logprobs.append(
                dict(zip(ids, out.top_logprobs[row, :num_top].tolist(), strict=True))
            )
        is_eos = token in self.eos_token_ids and not seq.request.ignore_eos
        if is_eos or token in seq.request.stop_token_ids:
            result.finish_reason = "stop"
        elif len(seq.tokens) >= seq.max_len:
            result.finish_reason = "length"
