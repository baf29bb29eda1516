"""What the runner remembers per request, because the scheduler does not resend it.

`CachedRequest` is the runtime's `RequestState` (prompt, generated tokens, computed tokens,
block table, sampling and seed, a prompt given as embeddings) with vLLM's sampling parameters
beside it. A request is checked once, when it arrives (`refuse_unservable`): what the front end
lets through that the compiled model cannot serve fails that request alone
(`faults.RequestError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.core.sched.output import NewRequestData

from vllm_aot.plugin.faults import RequestError
from vllm_aot.runtime.request import RequestState
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


def refuse_unservable(
    new: NewRequestData, *, vocab_size: int, num_logprobs: int, hidden_size: int
) -> None:
    """RequestError for a request the front end accepted that the compiled model cannot serve.

    vLLM's front end checks most of this; it cannot when the tokenizer is skipped
    (`--skip-tokenizer-init`: token ids unchecked) or knows a larger vocabulary than the
    model's, a platform that allowed more logprobs than the head computes would let them
    through, and offline prompt embeddings reach the engine with their shape unchecked.
    """
    params = new.sampling_params
    if params is None:
        raise RequestError("vllm-aot serves generation requests only")
    if new.prompt_embeds is not None:
        refuse_unservable_embeds(new, hidden_size=hidden_size)
    prompt_token_ids = new.prompt_token_ids or []
    if new.prompt_is_token_ids is not None:  # its other positions hold a placeholder id
        pairs = zip(prompt_token_ids, new.prompt_is_token_ids, strict=True)
        prompt_token_ids = [t for t, is_token in pairs if is_token]
    outside = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(
            f"prompt token ids {outside[:5]} are outside the model's vocabulary "
            f"(0..{vocab_size - 1})"
        )
    for name in ("logprobs", "prompt_logprobs"):
        count = getattr(params, name)
        if count is not None and not 0 <= count <= num_logprobs:
            raise RequestError(f"{name}={count}: the head programs return at most {num_logprobs}")
    if params.prompt_logprobs is not None:
        refuse_unservable_prompt_logprobs(new)


def refuse_unservable_prompt_logprobs(new: NewRequestData) -> None:
    """RequestError for prompt logprobs the runner cannot compute: every prompt position is
    scored as its chunk runs, so the prompt's token ids and all its positions are needed."""
    if new.prompt_token_ids is None or new.prompt_is_token_ids is not None:
        raise RequestError("prompt_logprobs need every prompt token's id; prompt_embeds have none")
    if new.num_computed_tokens:
        raise RequestError(
            f"prompt_logprobs with {new.num_computed_tokens} prompt tokens from the prefix "
            "cache, whose hidden states are gone; leave skip_reading_prefix_cache unset"
        )


def refuse_unservable_embeds(new: NewRequestData, *, hidden_size: int) -> None:
    """RequestError for prompt embeddings the layer programs cannot take: [prompt tokens,
    hidden_size] finite floating point (cast to the model's dtype)."""
    embeds = new.prompt_embeds
    if embeds.ndim != 2 or embeds.shape[1] != hidden_size or not embeds.is_floating_point():
        raise RequestError(
            f"prompt_embeds of shape {tuple(embeds.shape)} and dtype {embeds.dtype}: the model "
            f"takes [tokens, {hidden_size}] floating point"
        )
    if not torch.isfinite(embeds).all():
        raise RequestError("prompt_embeds hold NaN or infinite values")


class Prompt(NamedTuple):
    """A request's prompt as the runtime takes it."""

    token_ids: list[int]  # placeholders (0) at positions given as embeddings without ids
    embeds: torch.Tensor | None  # [tokens, hidden] in the model's dtype, every position


def prompt_of(
    new: NewRequestData, *, embed: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Prompt:
    """The prompt of a new request (checked by `refuse_unservable`). Embeddings cover every
    position: a prompt mixing token ids and embeddings (`prompt_is_token_ids`, chat content
    parts) gets its tokens' embeddings from `embed` (the model's lookup, [n] -> [n, hidden]),
    so each request gives the layer programs one kind of input."""
    token_ids, embeds = new.prompt_token_ids, new.prompt_embeds
    if embeds is None:
        return Prompt(list(token_ids), None)
    embeds = embeds.to(dtype)
    if token_ids is None:
        return Prompt([0] * len(embeds), embeds)
    is_token = new.prompt_is_token_ids
    if is_token is None:
        return Prompt(list(token_ids), embeds)
    token_ids = [t if given else 0 for t, given in zip(token_ids, is_token, strict=True)]
    rows = torch.tensor(is_token, dtype=torch.bool)[:, None]  # [tokens, 1]
    own = embed(torch.tensor(token_ids, dtype=torch.int64)).to(dtype)
    return Prompt(token_ids, torch.where(rows, own, embeds))


def needs_logits_processing(params: VllmSamplingParams) -> bool:
    """Whether sampling must see processed logits on the host (penalties, logit bias)."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
    )


def bans_tokens(params: VllmSamplingParams) -> bool:
    """Whether some tokens are out this step by the request's rules (min_tokens' stop tokens,
    bad words, allowed tokens): its vocabulary mask says which (`plugin/logits.vocab_mask`)."""
    return bool(params.min_tokens or params.bad_words_token_ids or params.allowed_token_ids)


@dataclass(kw_only=True)
class CachedRequest(RequestState):
    """The runtime's request state plus vLLM's sampling parameters (host-side processing reads
    them). Tokens generated by the runner are appended to `output_token_ids`."""

    params: VllmSamplingParams  # the request's own; never mutated

    @classmethod
    def new(
        cls,
        *,
        req_id,
        prompt_token_ids,
        params,
        block_ids,
        num_computed_tokens,
        vocab_size,
        prompt_embeds=None,
    ) -> CachedRequest:
        """The runner's state for a new request (the runner checks it with `refuse_unservable`);
        `prompt_token_ids` and `prompt_embeds` as `prompt_of` gives them."""
        return cls(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=params.max_tokens,
            params=params,
            sampling=to_runtime_params(params, vocab_size),
            seed=params.seed if params.seed is not None else draw_seed(req_id),
            block_table=list(block_ids),
            num_computed_tokens=num_computed_tokens,
            prompt_embeds=prompt_embeds,
        )
