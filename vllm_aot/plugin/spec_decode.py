"""Speculative decoding through vLLM's seams: what is supported, and the drafter.

vLLM's `--speculative-config` reaches us three ways. At start the platform refuses what we cannot
run (`speculative_problems`) and compiles verify programs for `num_speculative_tokens`
(`RuntimeConfig`). Each step the scheduler hands a request its drafts
(`SchedulerOutput.scheduled_spec_decode_tokens`, `1 + len(drafts)` tokens scheduled); the runner
verifies them in one verify program and returns the accepted tokens plus one
(`ModelRunnerOutput.sampled_token_ids`), and vLLM's scheduler rolls back the rejected positions
(their K/V are overwritten by the next step before anything reads them). After the step the
engine asks for the next drafts (`take_draft_token_ids`): ours come from a drafter's `propose`.

Supported:
- `method: ngram` (`NgramDrafter`): prompt lookup, vLLM's own n-gram matcher on the host.
- `method: draft_model` (`ModelDrafter`, over `runtime/draft.py`): greedy drafts from a model's
  compiled programs. `model` naming the target itself is self-speculation: the target's first
  `draft_layers` layers (`--additional-config`, default half), its final norm and head, reading
  and writing the target's KV pool. Another model sharing the target's vocabulary drafts with
  its own programs, weights and pool (the target's block ids; vLLM reserves the lookahead slots
  its passes write), in the target's dtype, all its layers unless `draft_layers` cuts it.
- **Multi-step decoding** (`DraftPlan.multi_step`): self-speculation with every layer
  (`draft_layers` the target's depth). Each request's drafts are sampled as the request samples,
  so they are the target's own next tokens: no verify program is compiled or run, a step with
  drafts is one decode pass over each row's last draft, and it returns the drafts and that
  pass's token (k + 1 tokens a step, the engine's scheduling, output and streaming shared by
  them). A request asking logprobs decodes one token a step; a request's first token goes out
  as soon as it is sampled, its drafts start with its second.
A request gets no drafts while it uses structured outputs, host-side logits processing
(penalties, bias: its tokens come from the host) or rules that ban tokens (min_tokens, bad
words, allowed tokens: a mask each step), or when one more token
ends it (or reaches max_model_len); a decode batch larger than the largest verify program
decodes without drafts (a model drafter then drafts nothing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from vllm_aot.models.registry import encoder_architectures, supported_architectures
from vllm_aot.runtime.config import MAX_SPECULATIVE_TOKENS
from vllm_aot.runtime.draft import DraftGate, DraftRow, ModelDraft
from vllm_aot.runtime.inputs import VerifyRow
from vllm_aot.runtime.sampler import GREEDY

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
            f"{', '.join(SUPPORTED_METHODS)}: a draft model, or the target itself for a "
            "self-speculative draft from its first layers)"
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
    draft = spec_config.draft_model_config
    if model_config is not None and draft is not None and not is_self_draft(spec_config):
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


def is_self_draft(spec_config) -> bool:
    """Whether `method: draft_model` names the target itself: self-speculation."""
    if spec_config is None or spec_config.method != "draft_model":
        return False
    return names_target(spec_config.model, spec_config.target_model_config.model)


def names_target(draft: str | None, target: str) -> bool:
    """Whether a draft model's path (None: none given) is the target itself."""
    return draft is None or draft == target or os.path.realpath(draft) == os.path.realpath(target)


def is_multi_step(is_self: bool, draft_layers: int | str | None, total: int) -> bool:
    """The multi-step rule, stated once (`vllm-aot serve` asks it of a command line too): the
    target drafts for itself with its every layer (`draft_layers` "all" or its layer count)."""
    return is_self and draft_layers in ("all", total)


class DraftPlan(NamedTuple):
    """What `method: draft_model` drafts with (the `AotOptions` fields of the same names)."""

    draft_model: str | None = None  # the draft model's path; None for none or the target itself
    draft_layers: int | None = None  # its layers; None for all
    multi_step: bool = False  # the target drafting for itself with every layer


def draft_plan(spec_config, draft_layers: int | str | None) -> DraftPlan:
    """The plan from `--speculative-config` and `--additional-config`'s `draft_layers` (a
    count, or "all": the draft's every layer); ValueError for layers the draft does not have,
    or `draft_layers` without a draft model."""
    if spec_config is None or spec_config.method != "draft_model":
        if draft_layers is not None:
            raise ValueError(
                "--additional-config draft_layers needs --speculative-config method draft_model"
            )
        return DraftPlan()
    is_self = is_self_draft(spec_config)
    total = spec_config.draft_model_config.hf_config.num_hidden_layers
    if draft_layers == "all":
        draft_layers = total
    if draft_layers is not None and not isinstance(draft_layers, int):
        raise ValueError(f'draft_layers {draft_layers!r} (supported: 1..{total}, or "all")')
    if draft_layers is None:
        draft_layers = max(1, total // 2) if is_self else None
    if draft_layers is not None and not 1 <= draft_layers <= total:
        raise ValueError(f"draft_layers {draft_layers} (supported: 1..{total}, the draft's layers)")
    if is_self:
        return DraftPlan(None, draft_layers, multi_step=is_multi_step(True, draft_layers, total))
    return DraftPlan(spec_config.model, draft_layers)


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
    from vllm_aot.plugin.requests import bans_tokens, needs_logits_processing

    params = request.params
    remaining = request.max_tokens - len(request.output_token_ids)
    is_plain = not (needs_logits_processing(params) or bans_tokens(params))
    return params.structured_outputs is None and is_plain and remaining > 1


def _num_drafts(
    request: CachedRequest,
    tokens: Sequence[int],
    k: int,
    max_model_len: int,
    gate: DraftGate | None,
) -> int:
    """Drafts a request, whose tokens are now `tokens`, may take: none unless it `wants_drafts`
    and its drafts have been paying (`gate`; None: drafts that always pay); never a position the
    verify step cannot compute (past max_tokens or max_model_len)."""
    if gate is not None and not gate.allows(request.req_id, tokens):
        return 0
    if not wants_drafts(request):
        return 0
    remaining = request.max_tokens - len(request.output_token_ids)
    return max(0, min(k, remaining - 1, max_model_len - len(tokens)))


class ModelDrafter:
    """Drafts from a model's programs (`runtime/draft.py`) for the requests that sampled this
    step, all in one batch of passes, or none when the batch is wider than every verify
    program (it would decode without them). Greedy, or under multi-step decoding (`exact`: the
    whole target) sampled as each request samples, never gated, never verified."""

    def __init__(self, vllm_config, draft: ModelDraft, max_rows: int) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.draft = draft
        self.max_rows = max_rows
        self.gate = None if self.exact else DraftGate(is_shared=True)

    @property
    def exact(self) -> bool:
        """Multi-step decoding: the draft is the whole target (`ModelDraft.is_exact`)."""
        return self.draft.is_exact

    def forget(self, req_id: str) -> None:
        self.draft.forget(req_id)
        if self.gate is not None:
            self.gate.forget(req_id)

    def propose(self, requests: Sequence[CachedRequest]) -> DraftTokenIds:
        from vllm.v1.outputs import DraftTokenIds

        rows = []
        for request in requests:
            tokens = request.all_token_ids
            if self.exact and (
                request.params.logprobs is not None or len(request.output_token_ids) < 2
            ):
                # Its drafts' logprobs would be lost: one token a step. Its first token goes
                # out as soon as it is sampled (time to first token), drafting from the next.
                continue
            n = _num_drafts(request, tokens, self.k, self.max_model_len, self.gate)
            if n and (self.draft.shares_kv or request.prompt_embeds is None):
                params, seed = (request.sampling, request.seed) if self.exact else (GREEDY, 0)
                rows.append(DraftRow(request.req_id, tokens, request.block_table, n, params, seed))
        drafts = self.draft.propose(rows) if len(rows) <= self.max_rows else {}
        for row in rows:
            if self.gate is not None:
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
