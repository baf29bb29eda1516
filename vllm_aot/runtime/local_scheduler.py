"""The runtime's scheduler: `policy.schedule` over its own queues and KV block allocator.

The generate loop and teacher forcing drive their requests through it; in serving, AotScheduler
drives the same policy over vLLM's queues and block manager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from vllm_aot.runtime import policy
from vllm_aot.runtime.kv_cache import BlockAllocator
from vllm_aot.runtime.policy import Limits, Step, StepKind
from vllm_aot.runtime.request import RequestState


class Scheduler:
    def __init__(self, limits: Limits, allocator: BlockAllocator) -> None:
        self.limits = limits
        self.allocator = allocator
        self.waiting: deque[RequestState] = deque()  # in arrival order
        self.running: list[RequestState] = []  # in release order

    @property
    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, state: RequestState) -> None:
        """The request arrives: it waits behind every earlier one."""
        self.waiting.append(state)

    def schedule(self) -> Step[RequestState]:
        """The policy's next step. A released request moves to running and gets the KV blocks of
        its whole worst case at once, so it never needs more later."""
        step = policy.schedule(self.running, self.waiting, self.limits)
        if step.kind is StepKind.RELEASE:
            state = self.waiting.popleft()
            num_blocks = policy.worst_case_blocks(state, self.limits)
            state.block_table = self.allocator.allocate(num_blocks)
            self.running.append(state)
        assert step.requests, "admission must make progress: a request needs more KV blocks"
        return step

    def finish(self, states: Iterable[RequestState]) -> None:
        """The requests leave running; their blocks are free for the next step."""
        for state in list(states):
            self.running.remove(state)
            self.allocator.free(state.block_table)
