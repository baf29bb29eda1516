"""PoolingRunner: vLLM's SchedulerOutput for an encoder (runner "pooling") -> packed encode
steps -> each request's embedding in `ModelRunnerOutput.pooler_output`.

vLLM schedules an encoder's prompts whole (no chunked prefill, no prefix caching for
bidirectional attention) and as many a step as `max_num_seqs` and `max_num_batched_tokens`
allow; there is no KV cache and nothing carries over between steps, so every scheduled request
is new and finishes in its step. Its tokens are packed into encode buckets
(`EncoderModel.steps`), pooled as the model's pooler configuration says (`--pooler-config`, by
default the sentence-transformers directory's: CLS, MEAN or LAST) and L2-normalised when the
request's `use_activation` asks (vLLM's default for embeddings).

A request the model cannot serve (token ids outside the vocabulary, a dimension reduction)
fails alone (`faults.py`, reported in the output for `ReportingScheduler` to finish).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from vllm_aot.models.pooling import Pooling, pool
from vllm_aot.plugin.faults import AotRunnerOutput, RequestError, describe, is_per_request
from vllm_aot.runtime.encoder import EncoderModel
from vllm_aot.runtime.inputs import EncoderSequence

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it


@dataclass(frozen=True)
class PoolingRow:
    req_id: str
    sequence: EncoderSequence
    pooling: Pooling


def token_type_ids(new: NewRequestData) -> list[int] | None:
    """vLLM's token types of a sentence pair (`compressed_token_type_ids`: where type 1
    starts); None (all 0) for one sentence."""
    extra = new.pooling_params.extra_kwargs or {}
    start = extra.get("compressed_token_type_ids")
    if start is None:
        return None
    return [int(i >= start) for i in range(len(new.prompt_token_ids))]


class PoolingRunner:
    def __init__(self, model: EncoderModel, pooling_type: str) -> None:
        self.model = model
        self.pooling_type = pooling_type
        self.requests: dict[str, object] = {}  # none kept between steps (the worker asks)

    def _admit(self, new: NewRequestData) -> PoolingRow:
        """A new request as one sequence to encode; RequestError when the model cannot serve
        it."""
        params = new.pooling_params
        if params is None or new.prompt_token_ids is None:
            raise RequestError("vllm-aot's pooling runner serves pooling requests of token ids")
        vocab_size = self.model.arch.vocab_size
        bad = [t for t in new.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"token ids {bad[:4]} are outside the vocabulary (0..{vocab_size - 1})"
            )
        if params.dimensions is not None:
            raise RequestError(f"dimensions={params.dimensions}: only full embeddings are served")
        sequence = EncoderSequence(new.prompt_token_ids, token_type_ids(new))
        normalize = params.use_activation is not False
        return PoolingRow(new.req_id, sequence, Pooling(self.pooling_type, normalize))

    def _fail(self, exc: Exception, req_ids: Sequence[str], failed: dict[str, str]) -> None:
        if not is_per_request(exc, len(req_ids)):
            raise exc
        reason = describe(exc)
        logger.warning("vllm-aot: request %s failed: %s", ", ".join(req_ids), reason)
        failed.update(dict.fromkeys(req_ids, reason))

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Encode and pool every scheduled request; its embedding [hidden] float32 in
        `pooler_output`, None for one that failed."""
        if out.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert not out.scheduled_cached_reqs.req_ids, (
            "an encoder request scheduled twice: vLLM schedules encoder prompts whole"
        )
        failed: dict[str, str] = {}
        rows: list[PoolingRow] = []
        for new in out.scheduled_new_reqs:
            try:
                rows.append(self._admit(new))
            except Exception as exc:
                self._fail(exc, [new.req_id], failed)
        embeddings: dict[str, torch.Tensor] = {}
        for group in self._groups(rows):
            try:
                hidden = self.model.encode([r.sequence for r in group])
            except Exception as exc:
                self._fail(exc, [r.req_id for r in group], failed)
                continue
            for row, states in zip(group, hidden, strict=True):
                embeddings[row.req_id] = pool(states, row.pooling)
        req_ids = list(out.num_scheduled_tokens)
        return AotRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
            pooler_output=[embeddings.get(rid) for rid in req_ids],
            failed_requests=failed,
        )

    def _groups(self, rows: Sequence[PoolingRow]) -> list[list[PoolingRow]]:
        """Rows in the encode steps `EncoderModel.steps` packs their sequences into."""
        by_sequence = {id(r.sequence): r for r in rows}
        steps = self.model.steps([r.sequence for r in rows])
        return [[by_sequence[id(s)] for s in step] for step in steps]

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """Nothing to sample: `execute_model` returned the step's output."""
        return EMPTY_MODEL_RUNNER_OUTPUT
