"""AotScheduler: vLLM's scheduler running the steps `runtime/policy.py` decides.

vLLM's scheduler mixes decodes, prefill chunks and new requests in one step; a static-shape
backend runs prefill and decode as different programs, so each step here is what the policy
picks: a prompt in flight alone, one chunk; else the oldest ready waiting request released
alone if admission (rows and worst-case KV blocks) allows it; else every running request
decoding. vLLM's `Request` is the policy's `RequestView` as it is. With speculative decoding
a decode row carries its drafts (vLLM's scheduler adds them), unless the batch is wider than
every verify program; admission counts the drafts a request's last step may write.

This adapter owns what is vLLM's: which waiting requests are ready (grammar compiled), and
making `super().schedule()` build the chosen step. Requests are held in vLLM's own waiting queue,
in arrival order; running requests not in this step are set aside for the duration of
`super().schedule()` only. Requests the runner reports as failed (`faults.py`) finish with
vLLM's FINISHED_ERROR in `update_from_output` (`ReportingScheduler`); the others go on.

A pooling model (`PoolingScheduler`) takes vLLM's own steps, whole prompts, several a step, each
held while a request's prompts are still arriving (`Gathering`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_aot.plugin.faults import failed_requests
from vllm_aot.plugin.options import AotOptions
from vllm_aot.plugin.spec_decode import max_verify_rows
from vllm_aot.runtime import policy
from vllm_aot.runtime.policy import Limits, StepKind

_READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

# The longest a step waits for a request's prompts still arriving (`Gathering`).
MAX_GATHER_SECONDS = 0.02


def is_ready(request: Request) -> bool:
    """Schedulable now; a grammar compiled (or failed) counts, vLLM promotes it when it looks."""
    if request.status in _READY:
        return True
    if request.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        structured = request.structured_output_request
        return structured is not None and structured.grammar is not None
    return False


class ReportingScheduler(Scheduler):
    """vLLM's scheduler, finishing the requests our runner reports as failed."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """vLLM's update, with the requests the runner failed finished with an error first (so
        vLLM's loop skips them and their ids reach the front end in this step's outputs)."""
        failed = self._finish_failed(failed_requests(model_runner_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in failed:
            error = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            if request.client_index in outputs:
                outputs[request.client_index].outputs.append(error)
            else:
                outputs[request.client_index] = EngineCoreOutputs(outputs=[error])
        return outputs

    @contextlib.contextmanager
    def _held_back(self, requests: list[Request]) -> Iterator[None]:
        """`requests` out of vLLM's waiting queue while the block runs (so `super().schedule()`
        does not see them), then back behind anything still waiting, in their order."""
        self.waiting.remove_requests(requests)
        try:
            yield
        finally:
            for request in requests:
                self.waiting.add_request(request)

    def _finish_failed(self, failures: Mapping[str, str]) -> list[Request]:
        """Finish failed requests with FINISHED_ERROR (HTTP 500 for them); their blocks leave the
        prefix cache, since vLLM hashes a block when it allocates it, before its K/V exist, and
        the failed step may have written none or part of them."""
        if not failures:
            return []
        live = [req_id for req_id in failures if req_id in self.requests]  # not aborted meanwhile
        for req_id in live:
            for block_ids in self.kv_cache_manager.get_block_ids(req_id):
                self.kv_cache_manager.evict_blocks(set(block_ids))
        return self.finish_requests(live, RequestStatus.FINISHED_ERROR)


def batch_of(request_id: str) -> str | None:
    """The request a pooling prompt came in, from vLLM's ids: its front end names a request's
    i-th prompt `<request id>-<i>` and the engine appends `-<8 hex>`; None for another form
    (`LLM.embed`'s prompts are all queued before the first step)."""
    prompt = request_id.rpartition("-")[0]
    request, _, index = prompt.rpartition("-")
    return request if request and index.isdigit() else None


@dataclass
class Gathering:
    """Whether a step should wait for prompts still arriving. vLLM's front end hands a request
    of several inputs (`/v1/embeddings` with a list) to the engine one prompt at a time
    (docs/benchmarks.md#gathered-prompts); a step started on the first few runs small programs
    and leaves the rest for more.
    So a step is held while some request has two or more prompts waiting and more than at the
    last look, at most `max_seconds` from its first prompt (vLLM's loop looks again 1 ms after
    a step that ran nothing). A request's lone first prompt is not held: a request of one
    prompt never waits, and one of many at worst starts with a step of its first."""

    max_seconds: float = MAX_GATHER_SECONDS
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # prompts, first seen

    def hold(self, batches: Iterable[str | None], now: float) -> bool:
        counts = Counter(b for b in batches if b is not None)
        hold = False
        for batch, count in counts.items():
            num_seen, first = self.seen.get(batch, (0, now))
            hold |= count > max(num_seen, 1) and now - first < self.max_seconds
            self.seen[batch] = (count, first)
        for batch in self.seen.keys() - counts.keys():
            del self.seen[batch]
        return hold


class PoolingScheduler(ReportingScheduler):
    """vLLM's steps for pooling models, each held while a request's prompts are still arriving
    (`Gathering`), so its batch is packed into encode programs together."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gathering = Gathering()

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        batches = [batch_of(r.request_id) for r in self.waiting]
        if not self.gathering.hold(batches, time.monotonic()):
            return super().schedule(*args, **kwargs)
        with self._held_back(list(self.waiting)):  # an empty step: vLLM looks again in 1 ms
            return super().schedule(*args, **kwargs)


class AotScheduler(ReportingScheduler):
    @property
    def limits(self) -> Limits:
        config = self.scheduler_config
        return Limits(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            block_size=self.block_size,
            num_usable_blocks=self.kv_cache_config.num_blocks - 1,  # block 0: vLLM's null block
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_lookahead_tokens=self.num_spec_tokens,
        )

    @functools.cached_property
    def max_verify_rows(self) -> int:
        """The widest decode batch that takes drafts (0 without speculative decoding)."""
        return max_verify_rows(AotOptions.of(self.vllm_config).runtime)

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        waiting = list(self.waiting)
        ready = [r for r in waiting if is_ready(r)]
        step = policy.schedule(self.running, ready, self.limits)
        is_release = step.kind is StepKind.RELEASE
        active = [] if is_release else list(step.requests)  # a released one is still waiting
        held = [r for r in waiting if not (is_release and r is step.requests[0])]
        set_aside = [r for r in self.running if not any(r is a for a in active)]

        if step.kind is StepKind.DECODE and len(active) > self.max_verify_rows:
            for request in active:  # no verify program this wide: decode without drafts
                request.spec_token_ids = []
        with self._held_back(held):
            self.running = active
            try:
                output = super().schedule(*args, **kwargs)
            finally:
                self.running = set_aside + self.running
        is_prefill = step.kind is not StepKind.DECODE
        prefill_ids = {r.request_id for r in step.requests} if is_prefill else set()
        scheduled = set(output.num_scheduled_tokens)
        assert not scheduled & prefill_ids or len(scheduled) == 1, (
            f"AotScheduler built a mixed step: prefill {scheduled & prefill_ids}, "
            f"decode {scheduled - prefill_ids}"
        )
        return output


class AotAsyncScheduler(AotScheduler, AsyncScheduler):
    """The same steps under `--async-scheduling`: vLLM's AsyncScheduler keeps a placeholder for
    each token sampled but not yet returned, so a request decodes again before its last token
    is back (the runner has it) and is not scheduled past its max_tokens. The policy reads the
    same numbers: a request whose prompt is computed is decoding, placeholder or not."""
