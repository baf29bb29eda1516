"""A small continuous-batching generate loop over a CompiledModel (tests, validate, the demo).

Steps follow `runtime/policy.py`, as serving does: a step is all-prefill (one prompt's next
chunk) or all-decode (every running request); a waiting request is released only when the KV
blocks of its whole worst case are free, and gets them at once, so nothing is ever preempted.
All requests arrive together, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_aot.runtime import policy
from vllm_aot.runtime.kv_cache import BlockAllocator
from vllm_aot.runtime.local_scheduler import Scheduler
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.policy import Limits, StepKind
from vllm_aot.runtime.request import RequestState
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


class Generator:
    def __init__(self, model: CompiledModel, eos_token_ids: Sequence[int] = ()) -> None:
        self.model = model
        self.config = model.config
        self.eos_token_ids = tuple(eos_token_ids)
        self.allocator = BlockAllocator(model.kv.num_blocks)
        self.limits = Limits.of(model.config, model.kv.num_blocks)

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
        scheduler = Scheduler(self.limits, self.allocator)
        by_id: dict[str, tuple[GenerationRequest, GenerationResult]] = {}
        for i, request in enumerate(requests):
            state = self._new_state(str(i), request)
            by_id[state.req_id] = (request, GenerationResult(list(request.prompt_token_ids)))
            scheduler.add(state)
        while scheduler.has_requests:
            for state, out, row in self._run(scheduler.schedule()):
                self._append(state, *by_id[state.req_id], out, row)
            scheduler.finish(s for s in scheduler.running if by_id[s.req_id][1].finish_reason)
        return [result for _, result in by_id.values()]

    def _new_state(self, req_id: str, request: GenerationRequest) -> RequestState:
        seed = request.sampling.seed
        return RequestState(
            req_id=req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            sampling=request.sampling.normalized(),
            seed=seed if seed is not None else draw_seed(),
        )

    def _run(
        self, step: policy.Step[RequestState]
    ) -> list[tuple[RequestState, SamplerOutput, int]]:
        """Run the step; (state, output, row) for each request that sampled a token."""
        if step.kind is StepKind.DECODE:
            out = self.model.decode(
                [s.decode_row() for s in step.requests],
                [s.row_sampling(s.num_tokens) for s in step.requests],
            )
            for state in step.requests:
                state.num_computed_tokens += 1
            return [(state, out, row) for row, state in enumerate(step.requests)]
        (state,) = step.requests
        positions = policy.next_chunk(state, self.limits)
        out = self.model.prefill(
            [state.prefill_chunk(positions)], [state.row_sampling(positions.stop)]
        )
        state.num_computed_tokens = positions.stop
        # A chunk that does not reach the end of the prompt samples nothing.
        return [(state, out, 0)] if positions.stop == state.num_tokens else []

    def _append(
        self,
        state: RequestState,
        request: GenerationRequest,
        result: GenerationResult,
        out: SamplerOutput,
        row: int,
    ) -> None:
        token = int(out.tokens[row])
        state.output_token_ids.append(token)
        result.token_ids.append(token)
        result.logprobs.append(float(out.token_logprobs[row]))
        num_top = request.sampling.num_logprobs
        if num_top:
            ids = out.top_ids[row, :num_top].tolist()
            result.top_logprobs.append(
                dict(zip(ids, out.top_logprobs[row, :num_top].tolist(), strict=True))
            )
        is_eos = token in self.eos_token_ids and not request.ignore_eos
        if is_eos or token in request.stop_token_ids:
            result.finish_reason = "stop"
        elif state.num_tokens >= min(
            state.num_prompt_tokens + state.max_tokens, self.config.max_model_len
        ):
            result.finish_reason = "length"
