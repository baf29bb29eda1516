"""Speculative decoding through vLLM's seams: what is supported, and the drafter.

vLLM's `--speculative-config` reaches us three ways. At start the platform refuses what we cannot
run (`speculative_problems`) and compiles verify programs for `num_speculative_tokens`
(`RuntimeConfig`). Each step the scheduler hands a request its drafts
(`SchedulerOutput.scheduled_spec_decode_tokens`, `1 + len(drafts)` tokens scheduled); the runner
verifies them in one verify program and returns the accepted tokens plus one
(`ModelRunnerOutput.sampled_token_ids`), and vLLM's scheduler rolls back the rejected positions
(their K/V are overwritten by the next step before anything reads them). After the step the
engine asks for the next drafts (`take_draft_token_ids`): ours come from `Drafter.propose`.

Supported: `method: ngram` (prompt lookup: vLLM's own n-gram matcher, numba on the host). A
request gets no drafts while it uses structured outputs or host-side logits processing
(penalties, bias, bad words, min_tokens: its tokens come from the host), or when one more token
ends it; a decode batch larger than the largest verify program decodes without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from vllm_aot.runtime.config import MAX_SPECULATIVE_TOKENS
from vllm_aot.runtime.inputs import VerifyRow

if TYPE_CHECKING:  # the platform imports this module while vLLM's config is still loading
    from vllm.v1.outputs import DraftTokenIds

    from vllm_aot.plugin.requests import CachedRequest

SUPPORTED_METHODS = ("ngram",)
PLANNED_METHODS = ("draft_model", "a self-speculative draft from the target's first layers")


def speculative_problems(spec_config) -> list[str]:
    """What of `--speculative-config` vllm-aot cannot run, each naming what is supported."""
    if spec_config is None:
        return []
    problems = []
    if spec_config.method not in SUPPORTED_METHODS:
        problems.append(
            f"speculative method {spec_config.method!r} (supported: "
            f"{', '.join(SUPPORTED_METHODS)}; not yet: {', '.join(PLANNED_METHODS)})"
        )
    k = spec_config.num_speculative_tokens or 0
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        problems.append(f"num_speculative_tokens {k} (supported: 1..{MAX_SPECULATIVE_TOKENS})")
    return problems


def num_speculative_tokens(vllm_config) -> int:
    """Drafts per row the verify programs take (0 without speculative decoding)."""
    spec_config = vllm_config.speculative_config
    return 0 if spec_config is None else spec_config.num_speculative_tokens


def strip_padding(drafts: Sequence[int] | None) -> tuple[int, ...]:
    """A request's scheduled drafts without vLLM's padding (-1 and everything after it: the
    scheduler pads a resumed decode to 1 + k tokens whether or not drafts exist)."""
    real = []
    for token in drafts or ():
        if token < 0:
            break
        real.append(token)
    return tuple(real)


def run_verify(model, rows) -> tuple:
    """A verify step's layers for the runner's scheduled decode rows (each its newest token and
    drafts): `CompiledModel.forward_verify`'s (hidden, inputs)."""
    return model.forward_verify(
        [
            VerifyRow([r.request.token(r.start), *r.drafts], r.start, r.request.block_table)
            for r in rows
        ]
    )


def wants_drafts(request: CachedRequest) -> bool:
    """Whether a request's next step may verify drafts (see the module docstring)."""
    from vllm_aot.plugin.requests import needs_logits_processing

    params = request.params
    remaining = request.max_tokens - len(request.output_token_ids)
    return (
        params.structured_outputs is None and not needs_logits_processing(params) and remaining > 1
    )


class Drafter:
    """Prompt-lookup drafts for the requests that sampled this step: vLLM's n-gram matcher (the
    kernel of its `NgramProposer`), one request at a time. Its batch entry point is a parallel
    numba loop whose OpenMP pool is not torch's: two pools of spinning threads on the engine's
    cores, for a loop that takes microseconds per request."""

    def __init__(self, vllm_config) -> None:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as propose_one,
        )

        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.max_model_len = vllm_config.model_config.max_model_len
        self._propose_one = propose_one
        self._propose_one(np.zeros(8, dtype=np.int32), self.min_n, self.max_n, 8, self.k)  # JIT

    def propose(self, requests: Sequence[CachedRequest]) -> DraftTokenIds:
        """Up to k drafts each, capped so a step never computes past the request's max_tokens."""
        from vllm.v1.outputs import DraftTokenIds

        drafts = []
        for request in requests:
            if not wants_drafts(request):
                drafts.append([])
                continue
            tokens = np.array(request.prompt_token_ids + request.output_token_ids, np.int32)
            remaining = request.max_tokens - len(request.output_token_ids)
            found = self._propose_one(tokens, self.min_n, self.max_n, self.max_model_len, self.k)
            drafts.append(found[: remaining - 1].tolist())
        return DraftTokenIds([r.req_id for r in requests], drafts)
