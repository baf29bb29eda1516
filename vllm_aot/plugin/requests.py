"""What the runner remembers per request, because the scheduler does not resend it."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams as VllmSamplingParams

from vllm_aot.runtime.sampler import SamplingParams, draw_seed


def to_runtime_params(params: VllmSamplingParams, vocab_size: int) -> SamplingParams:
    """vLLM's sampling parameters -> the runtime's (normalised; the caller's are untouched)."""
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    return SamplingParams(
        temperature=params.temperature,
        top_k=top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=params.seed,
        num_logprobs=params.logprobs,
    ).normalized()


def needs_logits_processing(params: VllmSamplingParams) -> bool:
    """Whether sampling must see processed logits (penalties, bias, bans) on the host."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
        or params.min_tokens
        or params.bad_words_token_ids
        or params.allowed_token_ids
    )


@dataclass
class CachedRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: VllmSamplingParams  # the request's own; never mutated
    sampling: SamplingParams  # normalised runtime parameters
    seed: int
    block_table: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, *, req_id, prompt_token_ids, params, block_ids, num_computed_tokens, vocab_size):
        sampling = to_runtime_params(params, vocab_size)
        return cls(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            sampling=sampling,
            seed=params.seed if params.seed is not None else draw_seed(),
            block_table=list(block_ids),
            num_computed_tokens=num_computed_tokens,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def tokens(self, start: int, stop: int) -> list[int]:
        return [self.token(p) for p in range(start, stop)]
