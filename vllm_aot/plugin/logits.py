"""Host-side logits processing for requests that need it, in vLLM's order and semantics.

Penalties, logit bias, min_tokens, bad words and allowed tokens change the distribution in ways
the compiled head program does not model; rows that use them are re-sampled here (`resample`)
from the raw logits the program returned, by the head's own sampler (`sample_rows`) with the
row's seed and mask. Their logprobs stay vLLM's raw ones, of that row's unprocessed logits. Rows
that use none of them keep the on-device result.
"""

from __future__ import annotations

import torch

from vllm_aot.plugin.requests import CachedRequest
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.inputs import RowSampling, prepare_sampling
from vllm_aot.runtime.sampler import SamplerOutput, sample_rows


def resample(
    logits: torch.Tensor, request: CachedRequest, sampling: RowSampling, config: RuntimeConfig
) -> SamplerOutput:
    """One row's raw logits [vocab] float32 -> a one-row SamplerOutput drawn after processing.

    The token comes from the processed logits; its logprob, rank and the top-n from `logits`.
    """
    tensors = prepare_sampling([sampling], 1, logits.shape[-1])
    return sample_rows(
        logits[None],
        tensors,
        is_greedy=sampling.params.is_greedy,
        num_logprobs=config.num_logprobs,
        num_candidates=config.num_sampling_candidates,
        processed=process_logits(logits, request)[None],
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
        counts = torch.bincount(torch.tensor(outputs), minlength=vocab_size)[:vocab_size].float()
        out -= params.frequency_penalty * counts
        out -= params.presence_penalty * (counts > 0).float()
    return out
