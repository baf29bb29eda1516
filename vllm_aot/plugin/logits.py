"""What a request's sampling rules do beyond the compiled head, in vLLM's semantics.

- Bans (min_tokens' stop tokens until it has that many, bad words whose prefix was just
  generated, tokens outside allowed_token_ids) are bits cleared in the row's vocabulary mask
  (`vocab_mask`, with a structured output's grammar mask), which the head program applies
  itself: no logits leave it.
- Penalties and logit bias change the logits in ways the head does not model: rows that use them
  are processed here one by one (`process_logits`) from the raw logits the program returned,
  then a step's processed rows are re-sampled together (`resample`) by the head's own sampler
  and kernels, each row with its seed and mask.

Logprobs stay vLLM's raw ones, of the row's unprocessed, unmasked logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm_aot.kernels import (
    logprob_stats_kernel,
    logprobs_impl,
    sample_tokens_kernel,
    sampling_impl,
)
from vllm_aot.plugin.requests import CachedRequest, bans_tokens
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.inputs import RowSampling, prepare_sampling
from vllm_aot.runtime.sampler import SamplerOutput, mask_words, sample_rows


def resample(
    logits: torch.Tensor,
    processed: Sequence[torch.Tensor],
    sampling: Sequence[RowSampling],
    config: RuntimeConfig,
) -> SamplerOutput:
    """Rows' raw logits [rows, vocab] float32 and their processed copies ([vocab] each, in
    order: `process_logits`) -> a SamplerOutput of those rows, each token drawn from its
    processed row by the head's own kernels (the draw and the logprob statistics the head
    programs call, or their torch references where kernels do not build); logprobs, ranks and
    the top-n from the raw rows.
    """
    tensors = prepare_sampling(sampling, len(sampling), logits.shape[-1])
    return sample_rows(
        logits,
        tensors,
        is_greedy=all(s.params.is_greedy for s in sampling),
        num_logprobs=config.num_logprobs,
        num_candidates=config.num_sampling_candidates,
        processed=torch.stack(list(processed)),
        draw=sample_tokens_kernel(sampling_impl()),
        stats=logprob_stats_kernel(logprobs_impl()),
    )


def draw_processed(
    logits: torch.Tensor,
    requests: Sequence[CachedRequest],
    sampling: Sequence[RowSampling],
    config: RuntimeConfig,
    *,
    on_failure: Callable[[Exception, list[str]], None],
) -> list[tuple[CachedRequest, SamplerOutput, int]]:
    """The rows of a step that need host-side processing, their raw logits [rows, vocab]
    float32: each row processed (`process_logits`; a failure there is its request's alone),
    then the rest drawn together (`resample`; a failure there is theirs), failures reported to
    `on_failure(exc, req_ids)`. Each drawn request with the output holding it and its row."""
    kept = []
    for i, request in enumerate(requests):
        try:
            kept.append((i, request, process_logits(logits[i], request)))
        except Exception as exc:
            on_failure(exc, [request.req_id])
    if not kept:
        return []
    rows, drawn, processed = zip(*kept, strict=True)
    try:
        out = resample(logits[list(rows)], processed, [sampling[i] for i in rows], config)
    except Exception as exc:
        on_failure(exc, [r.req_id for r in drawn])
        return []
    return [(request, out, j) for j, request in enumerate(drawn)]


def grammar_masks(grammar_output) -> dict[str, torch.Tensor]:
    """req_id -> packed int32 vocabulary mask, for structured-output requests this step."""
    if grammar_output is None:
        return {}
    bitmask = torch.from_numpy(np.asarray(grammar_output.grammar_bitmask, dtype=np.int32))
    return {
        req_id: bitmask[i] for i, req_id in enumerate(grammar_output.structured_output_request_ids)
    }


def vocab_mask(
    request: CachedRequest, grammar: torch.Tensor | None, vocab_size: int
) -> torch.Tensor | None:
    """The row's packed vocabulary mask this step ([ceil(vocab / 32)] int32, a set bit allows
    its token; None allows every token): the grammar's, if any, less the request's bans."""
    params = request.params
    if not bans_tokens(params):
        return grammar
    banned = []
    outputs = request.output_token_ids
    if len(outputs) < params.min_tokens:
        banned += params.all_stop_token_ids
    for word in params.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or outputs[-len(prefix) :] == prefix:
            banned.append(word[-1])
    banned_ids = np.array([t for t in banned if 0 <= t < vocab_size], np.int64)
    if not params.allowed_token_ids and not len(banned_ids):
        return grammar  # nothing out this step (min_tokens reached, no bad word's prefix)
    if grammar is None:
        words = np.full(mask_words(vocab_size), -1, dtype=np.int32)
    else:
        words = grammar.numpy().copy()
    bits = words.view(np.uint32)
    if params.allowed_token_ids:
        allowed = np.zeros_like(bits)
        ids = np.array([t for t in params.allowed_token_ids if 0 <= t < vocab_size], np.int64)
        np.bitwise_or.at(allowed, ids >> 5, _bit(ids))
        bits &= allowed
    np.bitwise_and.at(bits, banned_ids >> 5, ~_bit(banned_ids))
    return torch.from_numpy(words)


def _bit(ids: np.ndarray) -> np.ndarray:
    """Each token's bit within its mask word, uint32."""
    return np.uint32(1) << (ids & 31).astype(np.uint32)


def process_logits(logits: torch.Tensor, request: CachedRequest) -> torch.Tensor:
    """One row: logits [vocab] float32 -> a copy with the request's logit bias and penalties."""
    params = request.params
    out = logits.clone()
    vocab_size = out.shape[0]
    outputs = request.output_token_ids
    for token, bias in (params.logit_bias or {}).items():
        if 0 <= int(token) < vocab_size:
            out[int(token)] += bias
    if params.repetition_penalty != 1.0:
        prompt = request.prompt_token_ids if request.prompt_embeds is None else []
        seen = torch.tensor(prompt + outputs, dtype=torch.int64).unique()
        values = out[seen]
        penalty = params.repetition_penalty
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if outputs and (params.frequency_penalty or params.presence_penalty):
        # Only the tokens already generated move: their counts, not a vocabulary of zeros.
        ids, counts = torch.tensor(outputs, dtype=torch.int64).unique(return_counts=True)
        ids, counts = ids[ids < vocab_size], counts[ids < vocab_size]
        out[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
    return out
