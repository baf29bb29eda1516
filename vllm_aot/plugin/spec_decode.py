"""Speculative decoding through vLLM's seams: what is supported, and the drafters.

vLLM's `--speculative-config` reaches us three ways. At start the platform refuses what we cannot
run (`speculative_problems`) and compiles verify programs for `num_speculative_tokens`
(`RuntimeConfig`). Each step the scheduler hands a request its drafts
(`SchedulerOutput.scheduled_spec_decode_tokens`, `1 + len(drafts)` tokens scheduled); the runner
verifies them in one verify program and returns the accepted tokens plus one
(`ModelRunnerOutput.sampled_token_ids`), and vLLM's scheduler rolls back the rejected positions
(their K/V are overwritten by the next step before anything reads them). After the step the
engine asks for the next drafts (`take_draft_token_ids`): ours come from the `Drafter` that
`make_drafter` picks for the method, whatever it is.

Supported:
- `method: ngram` (`NgramDrafter`): prompt lookup, vLLM's own n-gram matcher on the host.
- `method: draft_model` (`ModelDrafter`, over `runtime/draft.py`): greedy drafts from another
  model sharing the target's vocabulary, with its own programs, weights and pool (the target's
  block ids; vLLM reserves the lookahead slots its passes write), in the target's dtype.
A request gets no drafts while it uses structured outputs, host-side logits processing
(penalties, bias: its tokens come from the host) or rules that ban tokens (min_tokens, bad
words, allowed tokens: a mask each step), or when one more token
ends it (or reaches max_model_len); a decode batch larger than the largest verify program
decodes without drafts (a model drafter then drafts nothing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from vllm_aot.models.registry import encoder_architectures, supported_architectures
from vllm_aot.runtime.config import MAX_SPECULATIVE_TOKENS, RuntimeConfig
from vllm_aot.runtime.draft import DraftGate, DraftRow, ModelDraft
from vllm_aot.runtime.inputs import VerifyRow
from vllm_aot.runtime.model import CompiledModel

if TYPE_CHECKING:  # the platform imports this module while vLLM's config is still loading
    from vllm.v1.outputs import DraftTokenIds

    from vllm_aot.plugin.requests import CachedRequest

SUPPORTED_METHODS = ("ngram", "draft_model")


def speculative_problems(
    spec_config, model_config=None, tensor_parallel_size: int = 1
) -> list[str]:
    """What of `--speculative-config` vllm-aot cannot run, each naming what is supported."""
    if spec_config is None:
        return []
    problems = []
    if spec_config.method not in SUPPORTED_METHODS:
        problems.append(
            f"speculative method {spec_config.method!r} (supported: "
            f"{', '.join(SUPPORTED_METHODS)}: prompt lookup, or a draft model)"
        )
    k = spec_config.num_speculative_tokens or 0
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        problems.append(f"num_speculative_tokens {k} (supported: 1..{MAX_SPECULATIVE_TOKENS})")
    if spec_config.method == "draft_model":
        problems += _draft_model_problems(spec_config, model_config, tensor_parallel_size)
    return problems


def _draft_model_problems(spec_config, model_config, tensor_parallel_size: int) -> list[str]:
    problems = []
    if tensor_parallel_size > 1:
        problems.append("method draft_model with --tensor-parallel-size > 1 (supported: 1)")
    if spec_config.quantization is not None:
        problems.append(
            "a quantized draft model (the draft runs in the target's dtype; give no quantization)"
        )
    if names_target(spec_config.model, spec_config.target_model_config.model):
        problems.append(
            "a draft model that is the served model itself (supported: another, smaller model "
            "sharing its vocabulary)"
        )
        return problems
    draft = spec_config.draft_model_config
    if model_config is not None and draft is not None:
        archs = list(getattr(draft.hf_config, "architectures", None) or [])
        decoders = sorted(set(supported_architectures()) - set(encoder_architectures()))
        if not set(archs) & set(decoders):
            problems.append(f"draft model architecture {archs} (supported: {', '.join(decoders)})")
        target_vocab = model_config.hf_config.vocab_size
        if draft.hf_config.vocab_size != target_vocab:
            problems.append(
                f"draft model vocabulary {draft.hf_config.vocab_size} "
                f"(supported: the target's, {target_vocab})"
            )
    return problems


def names_target(draft: str | None, target: str) -> bool:
    """Whether a draft model's path (None: none given) is the target itself."""
    return draft is None or draft == target or os.path.realpath(draft) == os.path.realpath(target)


def draft_model_path(spec_config) -> str | None:
    """The draft model `--speculative-config` names (`AotOptions.draft_model`); None without
    `method: draft_model`."""
    if spec_config is None or spec_config.method != "draft_model":
        return None
    return spec_config.model


def num_speculative_tokens(vllm_config) -> int:
    """Drafts per row the verify programs take (0 without speculative decoding)."""
    spec_config = vllm_config.speculative_config
    return 0 if spec_config is None else spec_config.num_speculative_tokens


def max_verify_rows(runtime: RuntimeConfig) -> int:
    """The widest decode batch that takes drafts: the largest verify program's (0 without
    speculative decoding)."""
    return max(runtime.verify_batch_buckets, default=0)


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
    from vllm_aot.plugin.requests import bans_tokens, needs_logits_processing

    params = request.params
    remaining = request.max_tokens - len(request.output_token_ids)
    is_plain = not (needs_logits_processing(params) or bans_tokens(params))
    return params.structured_outputs is None and is_plain and remaining > 1


def _num_drafts(
    request: CachedRequest, tokens: Sequence[int], k: int, max_model_len: int, gate: DraftGate
) -> int:
    """Drafts a request, whose tokens are now `tokens`, may take: none unless it `wants_drafts`
    and its drafts have been paying (`gate`); never a position the verify step cannot compute
    (past max_tokens or max_model_len)."""
    if not gate.allows(request.req_id, tokens) or not wants_drafts(request):
        return 0
    remaining = request.max_tokens - len(request.output_token_ids)
    return max(0, min(k, remaining - 1, max_model_len - len(tokens)))


class Drafter(Protocol):
    """What the runner asks of speculative decoding, whichever the method."""

    def propose(self, requests: Sequence[CachedRequest]) -> DraftTokenIds:
        """The next step's drafts of the requests that sampled this step (none for some)."""
        ...

    def forget(self, req_id: str) -> None:
        """Drop a request's drafting state (finished, failed, or resumed with fresh blocks)."""
        ...


def make_drafter(
    vllm_config, runtime: RuntimeConfig, draft_model: CompiledModel | None = None
) -> Drafter | None:
    """The drafter `--speculative-config` asks for (None: no speculative decoding):
    `draft_model` is the built draft model of `method: draft_model`."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDrafter(vllm_config)
    assert draft_model is not None, f"method {spec.method} needs its draft model built"
    return ModelDrafter(vllm_config, ModelDraft(draft_model), max_verify_rows(runtime))


class ModelDrafter:
    """Greedy drafts from a draft model's programs (`runtime/draft.py`) for the requests that
    sampled this step, all in one batch of passes, or none when the batch is wider than every
    verify program (it would decode without them)."""

    def __init__(self, vllm_config, draft: ModelDraft, max_rows: int) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.draft = draft
        self.max_rows = max_rows
        self.gate = DraftGate(is_shared=True)

    def forget(self, req_id: str) -> None:
        self.draft.forget(req_id)
        self.gate.forget(req_id)

    def propose(self, requests: Sequence[CachedRequest]) -> DraftTokenIds:
        from vllm.v1.outputs import DraftTokenIds

        rows = []
        for request in requests:
            tokens = request.all_token_ids
            n = _num_drafts(request, tokens, self.k, self.max_model_len, self.gate)
            if n and request.prompt_embeds is None:  # the draft has no embeddings of its own
                rows.append(DraftRow(request.req_id, tokens, request.block_table, n))
        drafts = self.draft.propose(rows) if len(rows) <= self.max_rows else {}
        for row in rows:
            self.gate.drafted(row.req_id, len(row.tokens), drafts.get(row.req_id, ()))
        return DraftTokenIds(
            [r.req_id for r in requests], [drafts.get(r.req_id, []) for r in requests]
        )


class NgramDrafter:
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
        self.gate = DraftGate()

    def forget(self, req_id: str) -> None:
        self.gate.forget(req_id)

    def propose(self, requests: Sequence[CachedRequest]) -> DraftTokenIds:
        """Up to k drafts each, capped so a step never computes past the request's max_tokens."""
        from vllm.v1.outputs import DraftTokenIds

        drafts = []
        for request in requests:
            all_tokens = request.all_token_ids
            n = _num_drafts(request, all_tokens, self.k, self.max_model_len, self.gate)
            if not n:
                drafts.append([])
                continue
            tokens = np.array(all_tokens, np.int32)
            found = self._propose_one(tokens, self.min_n, self.max_n, self.max_model_len, self.k)
            drafts.append(found[:n].tolist())
            self.gate.drafted(request.req_id, len(tokens), drafts[-1])
        return DraftTokenIds([r.req_id for r in requests], drafts)
