"""AotModelRunner: vLLM's SchedulerOutput -> bucketed program runs -> vLLM's ModelRunnerOutput.

Per step: forget finished requests, record new and updated ones (`plugin/bookkeeping.py`: the
scheduler sends prompts, blocks and sampling parameters once; we keep the tokens we sample), then
run the layers in `execute_model` and the head in `sample_tokens`, after vLLM has computed the
grammar bitmask for structured-output requests. A step is one prompt's chunk or every running
request's decode (the policy's steps, `runtime/policy.py`, AotScheduler's guarantee). Decode rows
that carry drafts make the step a verify step (`plugin/spec_decode.py`): one verify program,
every row's accepted drafts plus one token back, and the next drafts proposed for
`take_draft_token_ids` (the `Drafter` of whichever method). While a profiler records, the
host-side phases are named ranges (`update_states`, `logits_processing`, `runner_output`) around
the model's own.

A failure that concerns one request (`faults.is_per_request`: a new request the model cannot
serve, a step of one request, one row's host-side processing) fails that request alone
(`RequestRunner.fail`); the other requests of the step keep their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
)

from vllm_aot.plugin.bookkeeping import RequestRunner
from vllm_aot.plugin.faults import AotRunnerOutput
from vllm_aot.plugin.logits import draw_processed, grammar_masks, vocab_mask
from vllm_aot.plugin.prompt_logprobs import PromptLogprobs
from vllm_aot.plugin.requests import (
    CachedRequest,
    needs_logits_processing,
    prompt_of,
    refuse_unservable,
)
from vllm_aot.plugin.spec_decode import Drafter, run_verify, strip_padding
from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling, VerifyInputs, prefill_key
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.policy import is_prefilling
from vllm_aot.runtime.sampler import SamplerOutput


@dataclass(frozen=True)
class ScheduledRow:
    request: CachedRequest
    start: int  # first position computed this step
    num_tokens: int  # tokens computed this step, drafts included
    drafts: tuple[int, ...] = ()  # drafted tokens to verify, after the newest

    @property
    def num_known(self) -> int:
        """Tokens computed this step that the request holds (all but the drafts)."""
        return self.num_tokens - len(self.drafts)

    @property
    def is_complete(self) -> bool:
        """The step reaches the end of the request's known tokens: a token is sampled."""
        return self.start + self.num_known == self.request.num_tokens

    def decode_row(self) -> DecodeRow:
        """A decode pass's input: the newest token."""
        return DecodeRow(self.request.token(self.start), self.start, self.request.block_table)

    @property
    def is_decode(self) -> bool:
        """The newest token past the prompt, and its drafts (the policy's `is_prefilling`)."""
        return self.num_known == 1 and not is_prefilling(self.request)


class Sampled(NamedTuple):
    """A request's sampled tokens: rows `row`.. of a head output (or of its host re-sampling),
    more than one when a verify step accepted drafts."""

    out: SamplerOutput
    row: int
    num_logprobs: int | None  # top-n the request asked for (None: no logprobs)
    num_tokens: int = 1  # rows of `out`

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens[self.row : self.row + self.num_tokens].tolist()


@dataclass(frozen=True)
class LayerOutput:
    """Hidden states of one program run, waiting for the head: rows[i] <-> hidden[i]."""

    rows: tuple[ScheduledRow, ...]
    hidden: torch.Tensor  # [row bucket, hidden]; a verify step's: [row bucket * (k + 1), hidden]
    tokens: torch.Tensor | None = None  # [step tokens, hidden]: a prefill step's every token
    verify: VerifyInputs | None = None  # a verify step's inputs (its drafts)


@dataclass
class PendingStep:
    """A step between `execute_model` and `sample_tokens`."""

    req_ids: list[str]  # every request scheduled, in the scheduler's order
    layers: list[LayerOutput]
    failed: dict[str, str]  # req_id -> reason, of the requests failed so far


class AotModelRunner(RequestRunner[CachedRequest]):
    def __init__(self, model: CompiledModel, drafter: Drafter | None = None) -> None:
        super().__init__()
        self.model = model
        self.prompt_logprobs = PromptLogprobs()  # requests whose prompt logprobs are in progress
        self._pending: PendingStep | None = None
        self.drafter = drafter  # None: no speculative decoding
        self._drafts: DraftTokenIds | None = None

    # -- state (plugin/bookkeeping.py) --------------------------------------------------------

    def forget(self, req_id: str) -> None:
        """A request leaves: its state, prompt logprobs in progress and draft state."""
        super().forget(req_id)
        self.prompt_logprobs.forget(req_id)
        if self.drafter is not None:
            self.drafter.forget(req_id)

    def update(self, req_id: str, state: CachedRequest, cached: CachedRequestData, i: int) -> None:
        """Blocks and computed tokens; a resumed request's tokens resent in full (its draft
        state gone with its blocks); sampled tokens vLLM discarded dropped (async scheduling)."""
        super().update(req_id, state, cached, i)
        if req_id in cached.resumed_req_ids:
            if self.drafter is not None:
                self.drafter.forget(req_id)
            all_tokens = cached.all_token_ids[req_id]
            state.output_token_ids = list(all_tokens[len(state.prompt_token_ids) :])
        if cached.num_output_tokens:
            del state.output_token_ids[cached.num_output_tokens[i] :]

    def admit(self, new: NewRequestData) -> CachedRequest:
        """A new request's state; RequestError when the compiled model cannot serve it."""
        arch, config = self.model.arch, self.model.config
        refuse_unservable(
            new,
            vocab_size=arch.vocab_size,
            num_logprobs=config.num_logprobs,
            hidden_size=arch.hidden_size,
        )
        prompt = prompt_of(new, embed=self.model.embed, dtype=config.torch_dtype)
        request = CachedRequest.new(
            req_id=new.req_id,
            prompt_token_ids=prompt.token_ids,
            params=new.sampling_params,
            block_ids=new.block_ids[0],
            num_computed_tokens=new.num_computed_tokens,
            vocab_size=arch.vocab_size,
            prompt_embeds=prompt.embeds,
        )
        self.prompt_logprobs.admit(request)
        return request

    # -- execution --------------------------------------------------------------------------

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the layers of this step; the head runs in `sample_tokens`.

        Returns the step's output at once when no request is left to sample (every one failed).
        """
        with self.model.spans("update_states"):
            failed = self.update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        req_ids = list(out.num_scheduled_tokens)
        rows = [
            self._scheduled_row(rid, n, out.scheduled_spec_decode_tokens.get(rid))
            for rid, n in out.num_scheduled_tokens.items()
            if rid in self.requests
        ]
        try:
            layers = [self._run_layers(rows)] if rows else []
        except Exception as exc:
            self.fail(exc, [r.request.req_id for r in rows], failed)
            layers = []
        if not layers:
            return self._runner_output(req_ids, {}, failed)
        self._pending = PendingStep(req_ids, layers, failed)
        return None

    def _scheduled_row(self, req_id: str, num_tokens: int, drafts) -> ScheduledRow:
        """vLLM's padding drafts (-1) are not computed: they leave `num_tokens` too."""
        request, real = self.requests[req_id], strip_padding(drafts)
        num_padding = len(drafts or ()) - len(real)
        return ScheduledRow(request, request.num_computed_tokens, num_tokens - num_padding, real)

    def _run_layers(self, rows: Sequence[ScheduledRow]) -> LayerOutput:
        """The step's layer programs: the one prefill chunk, or every row's decode."""
        num_decode = sum(r.is_decode for r in rows)
        assert num_decode in (0, len(rows)), (
            f"mixed step: {num_decode} decode and {len(rows) - num_decode} prefill rows; "
            "AotScheduler never schedules one"
        )
        if num_decode and any(r.drafts for r in rows):
            hidden, inputs = run_verify(self.model, rows)
            return LayerOutput(tuple(rows), hidden, verify=inputs)
        if num_decode:
            decode_rows = [r.decode_row() for r in rows]
            return LayerOutput(tuple(rows), self.model.forward_decode(decode_rows))
        prefill = self.model.forward_prefill([self._prefill_chunk(rows)])
        return LayerOutput(tuple(rows), prefill.last, prefill.tokens)

    def _prefill_chunk(self, rows: Sequence[ScheduledRow]) -> PrefillChunk:
        """A prefill step's one chunk: AotScheduler schedules one that fits a prefill program."""
        assert len(rows) == 1, (
            f"prefill step of {len(rows)} requests; AotScheduler runs one prompt chunk per step"
        )
        (row,) = rows
        chunk = row.request.prefill_chunk(range(row.start, row.start + row.num_tokens))
        assert prefill_key([chunk], self.model.config) is not None, (
            f"request {row.request.req_id}'s chunk of {row.num_tokens} tokens after "
            f"{row.start} cached fits no prefill program; max_num_batched_tokens must be the "
            f"largest prefill bucket ({max(self.model.config.prefill_token_buckets)})"
        )
        return chunk

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """Head programs (with structured-output masks), host-side processing, runner output."""
        if self._pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        step, self._pending = self._pending, None
        masks = grammar_masks(grammar_output)
        sampled: dict[str, Sampled] = {}
        prompt_logprobs: dict[str, LogprobsTensors] = {}
        for layer in step.layers:
            try:
                if layer.tokens is not None:
                    scored = self.prompt_logprobs.score_step(self.model, layer.rows, layer.tokens)
                    prompt_logprobs.update(scored)
                sampled.update(self._sample_layer(layer, masks, step.failed))
            except Exception as exc:
                self.fail(exc, [r.request.req_id for r in layer.rows], step.failed)
        with self.model.spans("runner_output"):
            return self._runner_output(step.req_ids, sampled, step.failed, prompt_logprobs)

    def _sample_layer(
        self, layer: LayerOutput, masks: dict[str, torch.Tensor], failed: dict[str, str]
    ) -> dict[str, Sampled]:
        """The head over one program run; rows needing logits processing re-sampled on the host
        (a failure there ends that row's request alone)."""
        vocab_size, config = self.model.arch.vocab_size, self.model.config
        sampling = [
            RowSampling(
                r.request.sampling,
                r.request.seed,
                r.start + r.num_known,
                vocab_mask(r.request, masks.get(r.request.req_id), vocab_size),
            )
            for r in layer.rows
        ]
        if layer.verify is None:
            out, num_accepted, n = self.model.sample(layer.hidden, sampling), None, 1
        else:
            out, num_accepted = self.model.sample_verify(layer.hidden, layer.verify, sampling)
            n = layer.verify.key.num_positions  # head rows per row
        sampled: dict[str, Sampled] = {}
        processed: list[int] = []  # rows drawn again after host-side processing
        for i, row in enumerate(layer.rows):
            if not row.is_complete:
                continue
            request = row.request
            if needs_logits_processing(request.params):  # rows with drafts never do
                processed.append(i)
                continue
            count = 1 if num_accepted is None else 1 + int(num_accepted[i])
            sampled[request.req_id] = Sampled(out, i * n, request.params.logprobs, count)
        if not processed:
            return sampled
        with self.model.spans("logits_processing"):
            redrawn = draw_processed(
                out.logits[[i * n for i in processed]],
                [layer.rows[i].request for i in processed],
                [sampling[i] for i in processed],
                config,
                on_failure=lambda exc, req_ids: self.fail(exc, req_ids, failed),
            )
        for request, resampled, j in redrawn:
            sampled[request.req_id] = Sampled(resampled, j, request.params.logprobs)
        return sampled

    def _runner_output(
        self,
        req_ids: Sequence[str],
        sampled: dict[str, Sampled],
        failed: dict[str, str],
        prompt_logprobs: dict[str, LogprobsTensors] | None = None,
    ) -> AotRunnerOutput:
        """Tokens for the sampled requests (none for a chunk that does not end its prompt, or a
        request that failed), their logprobs, the prompt logprobs of prompts ending here, and
        the failures."""
        tokens = []
        for req_id in req_ids:
            entry = sampled.get(req_id)
            new = [] if entry is None else entry.tokens
            if new:
                self.requests[req_id].output_token_ids.extend(new)
            tokens.append(new)
        if self.drafter is not None:
            self._drafts = self.drafter.propose([self.requests[r] for r in sampled])
        return AotRunnerOutput(
            req_ids=list(req_ids),
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=tokens,
            logprobs=_logprobs([sampled.get(rid) for rid in req_ids]),
            prompt_logprobs_dict={
                rid: table for rid, table in (prompt_logprobs or {}).items() if rid not in failed
            },
            failed_requests=failed,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step, once (vLLM's engine asks after each step)."""
        drafts, self._drafts = self._drafts, None
        return drafts


def _logprobs(entries: Sequence[Sampled | None]) -> LogprobsLists | None:
    """vLLM's layout from the head's outputs, a row per generated token (one per request
    without drafts; `cu_num_generated_tokens` gives each request's first): column 0 the sampled
    token, then the top-k (rows of requests without logprobs stay zero)."""
    wanted = [e.num_logprobs for e in entries if e is not None and e.num_logprobs is not None]
    if not wanted:
        return None
    k = max(wanted)
    counts = [1 if e is None else e.num_tokens for e in entries]
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    ids = np.zeros((starts[-1], k + 1), dtype=np.int32)
    values = np.zeros((starts[-1], k + 1), dtype=np.float32)
    ranks = np.zeros(starts[-1], dtype=np.int64)
    for i, entry in enumerate(entries):
        if entry is None or entry.num_logprobs is None:
            continue
        out, rows = entry.out, slice(entry.row, entry.row + entry.num_tokens)
        at = slice(starts[i], starts[i] + entry.num_tokens)
        ids[at, 0], values[at, 0] = out.tokens[rows].numpy(), out.token_logprobs[rows].numpy()
        ids[at, 1:] = out.top_ids[rows, :k].numpy()
        values[at, 1:] = out.top_logprobs[rows, :k].numpy()
        ranks[at] = out.token_ranks[rows].numpy()
    is_one_each = starts[-1] == len(entries)
    return LogprobsLists(ids, values, ranks, None if is_one_each else starts[:-1])
