"""Host-side logits processing for requests that need it, in vLLM's order and semantics.

Penalties, logit bias, min_tokens, bad words and allowed tokens change the distribution in ways
the compiled head program does not model; rows that use them are processed here one by one
(`process_logits`) from the raw logits the program returned, then a step's processed rows are
re-sampled together (`resample`) by the head's own sampler and kernels, each row with its seed
and mask. Their logprobs stay vLLM's raw ones, of that row's unprocessed logits. Rows
that use none of them keep the on-device result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_aot.kernels import (
    logprob_stats_kernel,
    logprobs_impl,
    sample_tokens_kernel,
    sampling_impl,
)
from vllm_aot.plugin.requests import CachedRequest
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.inputs import RowSampling, prepare_sampling
from vllm_aot.runtime.sampler import SamplerOutput, sample_rows


def resample(
    logits: torch.Tensor,
    processed: torch.Tensor,
    sampling: Sequence[RowSampling],
    config: RuntimeConfig,
) -> SamplerOutput:
    """Rows' raw logits and their processed copies, both [rows, vocab] float32 -> a SamplerOutput
    of those rows, each token drawn from its processed row by the head's own kernels (the draw
    and the logprob statistics the head programs call, or their torch references where kernels
    do not build); logprobs, ranks and the top-n from the raw rows.
    """
    tensors = prepare_sampling(sampling, len(sampling), logits.shape[-1])
    return sample_rows(
        logits,
        tensors,
        is_greedy=all(s.params.is_greedy for s in sampling),
        num_logprobs=config.num_logprobs,
        num_candidates=config.num_sampling_candidates,
        processed=processed,
        draw=sample_tokens_kernel(sampling_impl()),
        stats=logprob_stats_kernel(logprobs_impl()),
    )


def process_logits(logits: torch.Tensor, request: CachedRequest) -> torch.Tensor:
    """One row: logits [vocab] float32 -> processed copy."""
    params = request.params
    out = logits.clone()
    vocab_size = out.shape[0]
    if params.allowed_token_ids:
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        allowed[[t for t in params.allowed_token_ids if t < vocab_size]] = True
        out[~allowed] = float("-inf")
    outputs = request.output_token_ids
    for word in params.bad_words_token_ids or ():
        prefix = word[:-1]
        if not prefix or outputs[-len(prefix) :] == prefix:
            out[word[-1]] = float("-inf")
    if len(outputs) < params.min_tokens:
        stop_ids = [t for t in params.all_stop_token_ids if t < vocab_size]
        out[stop_ids] = float("-inf")
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
