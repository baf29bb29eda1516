"""AotScheduler: vLLM's scheduler behind a holdback queue with admission control.

vLLM's scheduler mixes decodes, prefill chunks and new requests in one step; a static-shape
backend runs prefill and decode as different programs, so each step here is one or the other:

- a prefill in flight (a prompt not fully computed) runs alone, one chunk per step;
- otherwise the oldest ready waiting request is released, alone, if admission allows it;
- otherwise every running request decodes.

Admission (no preemption is ever needed): fewer than max_num_seqs running, and the KV blocks of
every running request's worst case (prompt + max_tokens, capped at max_model_len) plus the new
one's fit the pool. Requests are held in vLLM's own waiting queue, in arrival order; running
requests not in this step are set aside for the duration of `super().schedule()` only.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

_READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def is_ready(request: Request) -> bool:
    """Schedulable now; a grammar compiled (or failed) counts, vLLM promotes it when it looks."""
    if request.status in _READY:
        return True
    if request.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        structured = request.structured_output_request
        return structured is not None and structured.grammar is not None
    return False


def is_prefilling(request: Request) -> bool:
    """Prompt tokens are still to be computed, or more than the one newest token.

    Checking the prompt matters when exactly one prompt token is left (a 65-token prompt after a
    64-token chunk): that step is a prefill to the runner (its position is inside the prompt, see
    ScheduledRow.is_decode), so it must run alone, never batched with decodes.
    """
    return (
        request.num_computed_tokens < request.num_prompt_tokens
        or request.num_tokens - request.num_computed_tokens > 1
    )


class AotScheduler(Scheduler):
    def _worst_case_blocks(self, request: Request) -> int:
        limit = self.scheduler_config.max_model_len
        tokens = min(request.num_prompt_tokens + request.max_tokens, limit)
        return -(-tokens // self.block_size)

    def can_admit(self, request: Request) -> bool:
        if len(self.running) >= self.scheduler_config.max_num_seqs:
            return False
        usable = self.kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
        reserved = sum(self._worst_case_blocks(r) for r in self.running)
        return reserved + self._worst_case_blocks(request) <= usable

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        prefilling = [r for r in self.running if is_prefilling(r)]
        waiting = list(self.waiting)
        release = None
        if prefilling:
            active = prefilling[:1]
        else:
            ready = next((r for r in waiting if is_ready(r)), None)
            if ready is not None and self.can_admit(ready):
                release, active = ready, []
            else:
                active = list(self.running)
        held = [r for r in waiting if r is not release]
        set_aside = [r for r in self.running if not any(r is a for a in active)]

        self.waiting.remove_requests(held)
        self.running = active
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.running = set_aside + self.running
            for request in held:  # behind anything still waiting, in their original order
                self.waiting.add_request(request)
        prefill_ids = {r.request_id for r in prefilling}
        if release is not None:
            prefill_ids.add(release.request_id)
        scheduled = set(output.num_scheduled_tokens)
        assert not scheduled & prefill_ids or len(scheduled) == 1, (
            f"AotScheduler built a mixed step: prefill {scheduled & prefill_ids}, "
            f"decode {scheduled - prefill_ids}"
        )
        return output
