"""Speculative decoding's acceptance step: the tail of the verify head programs.

A verify step computes, per row, the logits at its newest token and at each of its up to `k`
drafted tokens (`k + 1` positions). Position j's logits decide position j + 1's token; draft j
is accepted while every draft before it was. The row emits its accepted drafts and one more
token: the correction at the first rejected draft, or the bonus after the last one. Rows with
fewer drafts (none included) are padded; their padded positions are never accepted.

Every position draws its token through the sampler's one draw (`sampler.sample_rows`), at the
position's RNG counter, exactly as a decode step there would; a draft is accepted where it is
that token. Drafts here are proposed deterministically (prompt lookup, a draft model's argmax),
a point mass q(x) = 1, for which this is rejection sampling: the draw is x with probability p(x),
the target's sampling distribution at that position (accepted), and y != x with probability
p(y) = (1 - p(x)) p(y) / (1 - p(x)): the correction is drawn from p without x, renormalised, and
the output is distributed exactly as the target's. Greedy rows accept while the draft is the
argmax. A seeded request's tokens are the ones it would decode without drafts.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import torch

from vllm_aot.runtime.sampler import (
    DrawTokens,
    LogprobStats,
    SamplerOutput,
    SamplingTensors,
    sample_rows,
)
from vllm_aot.runtime.signature import Arg


class DraftTensors(NamedTuple):
    """Per-row drafts of a verify head program (`rows` = the head bucket; `signature.py`)."""

    token_ids: Annotated[torch.Tensor, Arg(("rows", "drafts"), torch.int64)]  # padded with 0
    num_drafts: Annotated[torch.Tensor, Arg(("rows",), torch.int64)]  # 0..k


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
    draw: DrawTokens | None = None,
) -> tuple[SamplerOutput, torch.Tensor]:
    """Tokens for every position of a verify step, and how many drafts each row accepted.

    logits: [rows * (k + 1), vocab] float32, row-major by row then position; `t` per row.
    Returns (the `SamplerOutput` of every position: row i's tokens are positions
    i * (k + 1) ... i * (k + 1) + num_accepted[i], the accepted drafts then the correction or
    bonus; logprobs describe the raw logits at each position) and num_accepted [rows] int64.
    """
    rows, k = drafts.token_ids.shape
    out = sample_rows(
        logits,
        expand_rows(t, k + 1),
        is_greedy=is_greedy,
        num_logprobs=num_logprobs,
        num_candidates=num_candidates,
        stats=stats,
        draw=draw,
    )
    # Draft j is checked at position j; position k has none (the bonus).
    drawn = out.tokens.view(rows, k + 1)[:, :k]
    has_draft = torch.arange(k, device=logits.device)[None, :] < drafts.num_drafts[:, None]
    accepted = (drawn == drafts.token_ids) & has_draft
    return out, accepted.long().cumprod(dim=1).sum(dim=1)  # [rows]
