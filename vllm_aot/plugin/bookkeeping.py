"""What every runner keeps per request, and how one request fails without the engine.

vLLM's scheduler sends a request's prompt, blocks and parameters once (`scheduled_new_reqs`),
then only what changed (`scheduled_cached_reqs`: new blocks, the computed tokens, fresh blocks
when a preempted request resumes), and the ids of the requests that finished or were aborted
(`finished_req_ids`). `RequestRunner` holds each request's state between steps (`requests`):
`update_states` forgets the finished ones, adds the new ones (the runner's `admit` builds a
state), and applies the updates (`update`, which a runner extends for what it keeps beyond the
block table and computed tokens). The generation runner (`plugin/runner.py`) and both pooling
runners (`plugin/pooling.py`) are `RequestRunner`s.

A failure that concerns one request (`faults.is_per_request`) goes through `fail`: the request
is forgotten and recorded in the step's `failed` (req_id -> reason), which the runner's output
reports (`AotRunnerOutput.failed_requests`) for the scheduler to finish it with an error while
the engine serves everyone else. Any other failure propagates (fatal).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Generic, TypeVar

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_aot.plugin.faults import RequestError, describe, is_per_request

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it

State = TypeVar("State")


class RequestRunner(Generic[State]):
    """A runner's per-request states (`requests`, req_id -> state), kept in step with vLLM's
    scheduler output. A state that vLLM updates between steps has a `block_table` (list of
    block ids) and `num_computed_tokens`."""

    def __init__(self) -> None:
        self.requests: dict[str, State] = {}

    def admit(self, new: NewRequestData) -> State:
        """A new request's state; RequestError when the runner cannot serve it."""
        raise NotImplementedError

    def forget(self, req_id: str) -> None:
        """A request leaves (finished, aborted or failed): its state and anything kept for it."""
        self.requests.pop(req_id, None)

    def update(self, req_id: str, state: State, cached: CachedRequestData, i: int) -> None:
        """Entry `i` of a step's cached requests: new blocks appended, or on resumption after
        preemption the fresh ones replacing them; the computed tokens."""
        new_blocks = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            state.block_table = list(new_blocks[0]) if new_blocks else []
        elif new_blocks is not None:
            state.block_table.extend(new_blocks[0])
        state.num_computed_tokens = cached.num_computed_tokens[i]

    def update_states(self, out: SchedulerOutput) -> dict[str, str]:
        """Forget finished requests, add new ones and apply the updates; the new requests that
        cannot be served are left out and returned (req_id -> reason)."""
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        failed: dict[str, str] = {}
        for new in out.scheduled_new_reqs:
            self.add(new, failed)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is not None:  # else failed in the step before, scheduled before vLLM knew
                self.update(req_id, state, cached, i)
        return failed

    def add(self, new: NewRequestData, failed: dict[str, str]) -> None:
        """Admit a new request; one that cannot be served fails alone (recorded in `failed`)."""
        try:
            self.requests[new.req_id] = self.admit(new)
        except Exception as exc:
            self.fail(exc, [new.req_id], failed)

    def fail(self, exc: Exception, req_ids: Sequence[str], failed: dict[str, str]) -> None:
        """`exc` ends the requests `req_ids` (forgotten, recorded in `failed`), or, when it is
        fatal (`faults.is_per_request`), propagates."""
        if not is_per_request(exc, len(req_ids)):
            raise exc
        reason = describe(exc)
        traceback = None if isinstance(exc, RequestError) else exc  # bad input needs none
        logger.warning(
            "vllm-aot: request %s failed: %s", ", ".join(req_ids), reason, exc_info=traceback
        )
        for req_id in req_ids:
            self.forget(req_id)
            failed[req_id] = reason
