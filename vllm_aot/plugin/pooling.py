"""The pooling runners: vLLM's SchedulerOutput -> our programs -> each request's embedding in
`ModelRunnerOutput.pooler_output`, after the step that reaches the end of its prompt.

- `PoolingRunner` (an encoder): vLLM schedules its prompts whole (no chunked prefill, no prefix
  caching for bidirectional attention), as many a step as `max_num_seqs` and
  `max_num_batched_tokens` allow; there is no KV cache and nothing carries over between steps.
  The step's prompts are packed into encode buckets (`EncoderModel.steps`).
- `DecoderPoolingRunner` (a decoder under vLLM's `--convert embed`): prompts arrive in chunks
  (vLLM chunks LAST-pooled ones; MEAN and CLS come whole), several a step; each step's chunks
  run in as few prefill programs as fit (`prefill_key`), their K/V written for the prompt's later
  chunks, and the final norm's outputs are pooled chunk by chunk (`PooledChunks`).

Both pool as the model's pooler configuration says (`--pooler-config`, by default the
sentence-transformers directory's for an encoder, LAST for a decoder) and L2-normalise when the
request's `use_activation` asks (vLLM's default for embeddings). Both keep their requests as
`RequestRunner`s (`plugin/bookkeeping.py`): a request the model cannot serve (token ids outside
the vocabulary, a dimension reduction) fails alone, reported in the output for
`PoolingScheduler` (a `ReportingScheduler`) to finish.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from vllm_aot.models.pooling import PooledChunks, Pooling, pool
from vllm_aot.plugin.bookkeeping import RequestRunner
from vllm_aot.plugin.faults import AotRunnerOutput, RequestError
from vllm_aot.runtime.encode_inputs import EncoderSequence
from vllm_aot.runtime.encoder import EncoderModel
from vllm_aot.runtime.inputs import PrefillChunk, prefill_key
from vllm_aot.runtime.model import CompiledModel


def token_type_ids(new: NewRequestData) -> list[int] | None:
    """vLLM's token types of a sentence pair (`compressed_token_type_ids`: where type 1
    starts); None (all 0) for one sentence."""
    extra = new.pooling_params.extra_kwargs or {}
    start = extra.get("compressed_token_type_ids")
    if start is None:
        return None
    return [int(i >= start) for i in range(len(new.prompt_token_ids))]


def pooling_of(new: NewRequestData, *, vocab_size: int, pooling_type: str) -> Pooling:
    """A new request's pooling; RequestError when the model cannot serve it."""
    params = new.pooling_params
    if params is None or new.prompt_token_ids is None:
        raise RequestError("vllm-aot's pooling runners serve pooling requests of token ids")
    bad = [t for t in new.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:4]} are outside the vocabulary (0..{vocab_size - 1})")
    if params.dimensions is not None:
        raise RequestError(f"dimensions={params.dimensions}: only full embeddings are served")
    return Pooling(pooling_type, normalize=params.use_activation is not False)


def pooling_output(
    out: SchedulerOutput, embeddings: dict[str, torch.Tensor], failed: dict[str, str]
) -> AotRunnerOutput:
    """A step's output: every scheduled request, its embedding when its prompt ended (None
    otherwise), no tokens."""
    req_ids = list(out.num_scheduled_tokens)
    return AotRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
        pooler_output=[embeddings.get(rid) for rid in req_ids],
        failed_requests=failed,
    )


@dataclass(frozen=True)
class EncoderRow:
    req_id: str
    sequence: EncoderSequence
    pooling: Pooling


class PoolingRunner(RequestRunner[EncoderRow]):
    """An encoder's requests live for one step: each is scheduled whole, encoded, pooled and
    forgotten."""

    def __init__(self, model: EncoderModel, pooling_type: str) -> None:
        super().__init__()
        self.model = model
        self.pooling_type = pooling_type

    def admit(self, new: NewRequestData) -> EncoderRow:
        vocab_size = self.model.arch.vocab_size
        pooling = pooling_of(new, vocab_size=vocab_size, pooling_type=self.pooling_type)
        sequence = EncoderSequence(new.prompt_token_ids, token_type_ids(new))
        return EncoderRow(new.req_id, sequence, pooling)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Encode and pool every scheduled request (each one new and whole)."""
        assert not out.scheduled_cached_reqs.req_ids, (
            "an encoder request scheduled twice: vLLM schedules encoder prompts whole"
        )
        failed = self.update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        rows = list(self.requests.values())
        embeddings: dict[str, torch.Tensor] = {}
        for group in self._groups(rows):
            try:
                hidden = self.model.encode([r.sequence for r in group])
            except Exception as exc:
                self.fail(exc, [r.req_id for r in group], failed)
                continue
            for row, states in zip(group, hidden, strict=True):
                embeddings[row.req_id] = pool(states, row.pooling)
        for row in rows:
            self.forget(row.req_id)
        return pooling_output(out, embeddings, failed)

    def _groups(self, rows: Sequence[EncoderRow]) -> list[list[EncoderRow]]:
        """Rows in the encode steps `EncoderModel.steps` packs their sequences into."""
        steps = self.model.steps([r.sequence for r in rows])
        return [[rows[i] for i in step] for step in steps]

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """Nothing to sample: `execute_model` returned the step's output."""
        return EMPTY_MODEL_RUNNER_OUTPUT


@dataclass
class PoolingPrompt:
    """A decoder's pooling request between steps."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int  # tokens in the KV cache (earlier chunks, a prefix hit)
    pooled: PooledChunks = field(repr=False)


class DecoderPoolingRunner(RequestRunner[PoolingPrompt]):
    """A decoder's prompts, pooled chunk by chunk; a prompt is forgotten once pooled whole."""

    def __init__(self, model: CompiledModel, pooling_type: str) -> None:
        super().__init__()
        self.model = model
        self.pooling_type = pooling_type

    def admit(self, new: NewRequestData) -> PoolingPrompt:
        vocab_size = self.model.arch.vocab_size
        pooling = pooling_of(new, vocab_size=vocab_size, pooling_type=self.pooling_type)
        return PoolingPrompt(
            list(new.prompt_token_ids),
            list(new.block_ids[0]),
            new.num_computed_tokens,
            PooledChunks(pooling),
        )

    def update(self, req_id: str, state: PoolingPrompt, cached: CachedRequestData, i: int) -> None:
        super().update(req_id, state, cached, i)
        if req_id in cached.resumed_req_ids:  # preempted: fresh blocks, pooled again
            state.pooled = PooledChunks(state.pooled.pooling)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's prompt chunks and pool them; a prompt's embedding after its last."""
        failed = self.update_states(out)
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        chunks = {
            rid: self._chunk(self.requests[rid], n)
            for rid, n in out.num_scheduled_tokens.items()
            if rid in self.requests
        }
        embeddings: dict[str, torch.Tensor] = {}
        for group in self._groups(chunks):
            try:
                states = self.model.prefill_states([chunks[rid] for rid in group])
            except Exception as exc:
                self.fail(exc, group, failed)
                continue
            for rid, chunk_states in zip(group, states, strict=True):
                prompt = self.requests[rid]
                prompt.pooled.add(chunk_states)
                if chunks[rid].num_cached + len(chunks[rid].token_ids) == len(prompt.token_ids):
                    embeddings[rid] = prompt.pooled.result()
                    self.forget(rid)
        return pooling_output(out, embeddings, failed)

    @staticmethod
    def _chunk(prompt: PoolingPrompt, num_tokens: int) -> PrefillChunk:
        start = prompt.num_computed_tokens
        return PrefillChunk(prompt.token_ids[start : start + num_tokens], start, prompt.block_table)

    def _groups(self, chunks: dict[str, PrefillChunk]) -> Iterable[list[str]]:
        """The step's chunks in order, as few to a prefill program as fit one (a chunk that
        fits none alone goes alone, for `prefill_states` to refuse naming the limits)."""
        group: list[str] = []
        for rid in chunks:
            candidate = [chunks[r] for r in (*group, rid)]
            if group and prefill_key(candidate, self.model.config) is None:
                yield group
                group = []
            group.append(rid)
        if group:
            yield group

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """Nothing to sample: `execute_model` returned the step's output."""
        return EMPTY_MODEL_RUNNER_OUTPUT
