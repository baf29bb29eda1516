"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt position after the first,
the prompt token's raw logprob and rank and the top-n, as vLLM's `ModelRunnerOutput` carries
them (`prompt_logprobs_dict`).

A prompt is prefilled in chunks; each chunk's positions are scored as it runs (the final hidden
states of its tokens through the head programs, `CompiledModel.score`: the same norm, LM head and
logprob statistics generation uses) into one [prompt tokens - 1, n + 1] table per request,
handed to vLLM whole in the step that ends the prompt (vLLM's engine returns no partial prefill
outputs). Position p's row is the logprob of prompt token p + 1; the first prompt token has none
(vLLM's output processor adds its `None`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_aot.plugin.requests import CachedRequest
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.request import RequestState


class ScheduledChunk(Protocol):
    """A request's tokens in a step (the runner's `ScheduledRow`)."""

    @property
    def request(self) -> RequestState: ...

    @property
    def start(self) -> int: ...  # first position computed this step

    @property
    def num_tokens(self) -> int: ...


@dataclass
class _InProgress:
    num_logprobs: int  # top-n besides the prompt token's
    table: LogprobsTensors  # [prompt tokens - 1, n + 1], filled chunk by chunk


class PromptLogprobs:
    """The requests asking for prompt logprobs whose prompt is still being prefilled."""

    def __init__(self) -> None:
        self._requests: dict[str, _InProgress] = {}

    def admit(self, request: CachedRequest) -> None:
        """Track a new request when it asks for prompt logprobs (`requests.refuse_unservable`
        checked them)."""
        num_logprobs = request.params.prompt_logprobs
        if num_logprobs is None:
            return
        num_rows = max(request.num_prompt_tokens - 1, 0)
        table = LogprobsTensors.empty_cpu(num_rows, num_logprobs + 1)
        self._requests[request.req_id] = _InProgress(num_logprobs, table)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def score_step(
        self, model: CompiledModel, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[str, LogprobsTensors]:
        """Score a prefill step's chunks of the requests tracked here, hidden [step tokens,
        hidden] their final hidden states packed in order; req_id -> table of each prompt the
        step ends."""
        tables = {}
        offset = 0
        for chunk in chunks:
            req_id = chunk.request.req_id
            if req_id in self._requests:
                part = hidden[offset : offset + chunk.num_tokens]
                table = self.score_chunk(model, chunk.request, chunk.start, part)
                if table is not None:
                    tables[req_id] = table
            offset += chunk.num_tokens
        return tables

    def score_chunk(
        self, model: CompiledModel, request: RequestState, start: int, hidden: torch.Tensor
    ) -> LogprobsTensors | None:
        """Score a prefill chunk of `request` from position `start`, hidden [chunk tokens,
        hidden] its final hidden states; the whole table when the chunk ends the prompt (the
        request is then forgotten), else None."""
        entry = self._requests[request.req_id]
        num_prompt = request.num_prompt_tokens
        stop = min(start + hidden.shape[0], num_prompt - 1)  # the last position predicts no
        if stop > start:  # prompt token
            targets = request.prompt_token_ids[start + 1 : stop + 1]
            out = model.score(hidden[: stop - start], targets)
            n = entry.num_logprobs
            rows = slice(start, stop)
            entry.table.logprob_token_ids[rows, 0] = out.tokens.to(torch.int32)
            entry.table.logprob_token_ids[rows, 1:] = out.top_ids[:, :n].to(torch.int32)
            entry.table.logprobs[rows, 0] = out.token_logprobs
            entry.table.logprobs[rows, 1:] = out.top_logprobs[:, :n]
            entry.table.selected_token_ranks[rows] = out.token_ranks.to(torch.int32)
        if start + hidden.shape[0] < num_prompt:
            return None
        del self._requests[request.req_id]
        return entry.table
