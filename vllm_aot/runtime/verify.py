"""Speculative decoding's acceptance step: the tail of the verify head programs.

A verify step computes, per row, the logits at its newest token and at each of its up to `k`
drafted tokens (`k + 1` positions). Position j's logits decide position j + 1's token; draft j
is accepted while every draft before it was. The row emits its accepted drafts and one more
token: the correction at the first rejected draft, or the bonus after the last one. Rows with
fewer drafts (none included) are padded; their padded positions are never accepted.

Drafts here are proposed deterministically (prompt lookup, a draft model's argmax), a point mass
q(x) = 1, so standard rejection sampling reduces to: accept draft x with probability p(x), the
target's sampling distribution at that position (temperature, min-p, top-k, top-p, mask:
`sampler.target_probs`); on rejection draw from p with x removed, renormalised. A token is then x
with probability p(x) and y != x with (1 - p(x)) p(y) / (1 - p(x)) = p(y): the output is
distributed exactly as the target's. Greedy rows (top_k 1) accept while the draft is the argmax;
their tokens are the argmaxes. The uniforms come from `seeded_uniform` at (seed, position): the
acceptance test reads the draft's own entry, the correction's race every other entry, so the two
are independent and a seeded request is reproducible.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_aot.runtime.sampler import (
    LogprobStats,
    SamplerOutput,
    SamplingTensors,
    logprob_stats,
    race,
    seeded_uniform,
    target_probs,
    unpack_vocab_mask,
)


class DraftTensors(NamedTuple):
    """Per-row drafts of a verify head program (`rows` = the head bucket)."""

    token_ids: torch.Tensor  # [rows, k] int64, padded with 0
    num_drafts: torch.Tensor  # [rows] int64, 0..k


def expand_rows(t: SamplingTensors, num_positions: int) -> SamplingTensors:
    """Each row's sampling settings repeated for its `num_positions` positions, the RNG counter
    advancing one per position: [rows * num_positions] per field."""
    fields = [f.repeat_interleave(num_positions, dim=0) for f in t]
    offsets = torch.arange(num_positions, device=t.positions.device).repeat(t.positions.shape[0])
    expanded = SamplingTensors(*fields)
    return expanded._replace(positions=expanded.positions + offsets)


def accept_drafts(
    logits: torch.Tensor,
    t: SamplingTensors,
    drafts: DraftTensors,
    *,
    is_greedy: bool,
    num_logprobs: int,
    num_candidates: int,
    stats: LogprobStats | None = None,
) -> tuple[SamplerOutput, torch.Tensor]:
    """Tokens for every position of a verify step, and how many drafts each row accepted.

    logits: [rows * (k + 1), vocab] float32, row-major by row then position; `t` per row.
    Returns (the `SamplerOutput` of every position: row i's tokens are positions
    i * (k + 1) ... i * (k + 1) + num_accepted[i], the accepted drafts then the correction or
    bonus; logprobs describe the raw logits at each position) and num_accepted [rows] int64.
    """
    rows, k = drafts.token_ids.shape
    n = k + 1
    vocab = logits.shape[-1]
    per_position = expand_rows(t, n)
    allowed = unpack_vocab_mask(per_position.vocab_mask, vocab)
    masked = logits.masked_fill(~allowed, float("-inf"))
    greedy_tokens = masked.argmax(dim=-1).view(rows, n)
    # Draft j is checked at position j; position k has none (the bonus).
    draft_ids = torch.cat([drafts.token_ids, torch.zeros_like(drafts.token_ids[:, :1])], dim=1)
    has_draft = torch.arange(n, device=logits.device)[None, :] < drafts.num_drafts[:, None]
    greedy_rows = (t.top_k == 1)[:, None]
    if is_greedy:
        accepted, tokens = draft_ids == greedy_tokens, greedy_tokens
    else:
        num_candidates = min(num_candidates, vocab)
        probs, keep = target_probs(masked, allowed, per_position, num_candidates)
        uniforms = seeded_uniform(per_position.seeds, per_position.positions, vocab)
        flat_drafts = draft_ids.view(-1, 1)
        kept_mass = torch.where(keep, probs, 0.0).sum(dim=-1)  # renormalise over keep
        p_draft = torch.where(keep, probs, 0.0).gather(1, flat_drafts)[:, 0] / kept_mass
        is_draft = torch.zeros_like(keep).scatter(1, flat_drafts, True)
        excluded = is_draft & has_draft.view(-1, 1)  # a correction is never the rejected draft
        drawn = race(probs, keep & ~excluded, uniforms).view(rows, n)
        u_draft = uniforms.gather(1, flat_drafts)[:, 0].view(rows, n)
        random_accepted = u_draft < p_draft.view(rows, n)
        accepted = torch.where(greedy_rows, draft_ids == greedy_tokens, random_accepted)
        tokens = torch.where(greedy_rows, greedy_tokens, drawn)
    accepted = accepted & has_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [rows]
    # Accepted positions emit their draft; the first other position its correction or bonus.
    tokens = torch.where(accepted, draft_ids, tokens).view(-1)
    token_logprobs, ranks, top_logprobs, top_ids = (stats or logprob_stats)(
        logits, tokens, num_logprobs
    )
    out = SamplerOutput(tokens, token_logprobs, ranks, top_logprobs, top_ids, logits)
    return out, num_accepted
