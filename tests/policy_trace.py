"""The steps `runtime/policy.py` takes for given arrivals, on hand-built requests (no model, no
vLLM): the trace every driver of the policy (the generate loop, AotScheduler) must reproduce.

A trace step is ("prefill", req_id, tokens computed) or ("decode", sorted ids of its rows).
Requests advance the way every driver advances them: a step that reaches the end of a request's
known tokens samples one token; a request finishes at max_tokens or max_model_len.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_aot.runtime import policy
from vllm_aot.runtime.policy import Limits, StepKind

MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
CHUNK = 64  # max_num_batched_tokens

TraceStep = tuple  # ("prefill", req_id, num_tokens) | ("decode", tuple of req_ids)


def limits(num_kv_blocks: int) -> Limits:
    """The limits of a pool of `num_kv_blocks` blocks (block 0 reserved) for this module's sizes."""
    return Limits(
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_usable_blocks=num_kv_blocks - 1,
        max_num_batched_tokens=CHUNK,
    )


@dataclass(frozen=True)
class Arrival:
    req_id: str
    num_prompt_tokens: int
    max_tokens: int
    step: int = 0  # it arrives before this step is scheduled


@dataclass
class View:
    """A hand-built request: just what the policy reads."""

    req_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.num_output_tokens >= self.max_tokens or self.num_tokens >= MAX_MODEL_LEN


# name -> (KV pool blocks, arrivals); each is a behaviour serving relies on.
SCENARIOS: dict[str, tuple[int, list[Arrival]]] = {
    "fifo": (65, [Arrival(r, 10, 3) for r in "ABC"]),
    "chunked": (65, [Arrival(r, 150, 2) for r in "AB"]),
    # 65 and 129 leave a one-token last chunk: still prompt, not a decode.
    "shapes": (
        65,
        [
            Arrival(f"r{i}", n, m)
            for i, (n, m) in enumerate(
                [(30, 5), (65, 3), (100, 8), (10, 2), (129, 4), (64, 6), (1, 3)]
            )
        ],
    ),
    # 20 usable blocks: A 8 and B 10 at worst, C's 10 more wait for A to finish.
    "worst_case": (21, [Arrival("A", 20, 100), Arrival("B", 20, 140), Arrival("C", 20, 140)]),
    "max_num_seqs": (200, [Arrival(f"r{i}", 10, 3 + i) for i in range(6)]),
    "late_prompt": (65, [Arrival("D", 10, 20), Arrival("P", 65, 2, step=1)]),
}


def simulate(arrivals: Sequence[Arrival], num_kv_blocks: int) -> list[TraceStep]:
    """The policy's steps until every request has finished."""
    lim = limits(num_kv_blocks)
    pending = deque(sorted(arrivals, key=lambda a: a.step))
    waiting: deque[View] = deque()
    running: list[View] = []
    trace: list[TraceStep] = []
    while pending or waiting or running:
        while pending and pending[0].step <= len(trace):
            a = pending.popleft()
            waiting.append(View(a.req_id, a.num_prompt_tokens, a.max_tokens))
        step = policy.schedule(running, waiting, lim)
        if step.kind is StepKind.RELEASE:
            running.append(waiting.popleft())
        trace.append(_advance(step, lim))
        running = [r for r in running if not r.is_finished]
    return trace


def simulate_scenario(name: str) -> list[TraceStep]:
    num_kv_blocks, arrivals = SCENARIOS[name]
    return simulate(arrivals, num_kv_blocks)


def _advance(step: policy.Step[View], lim: Limits) -> TraceStep:
    if step.kind is StepKind.DECODE:
        for request in step.requests:
            request.num_computed_tokens += 1
            request.num_output_tokens += 1
        return ("decode", tuple(sorted(r.req_id for r in step.requests)))
    (request,) = step.requests
    chunk = policy.next_chunk(request, lim)
    request.num_computed_tokens = chunk.stop
    if chunk.stop == request.num_tokens:
        request.num_output_tokens += 1
    return ("prefill", request.req_id, len(chunk))


def shapes(trace: Sequence[TraceStep]) -> list[tuple[str, int]]:
    """("prefill", tokens) or ("decode", rows) per step: what a driver without ids shows."""
    return [(s[0], s[2]) if s[0] == "prefill" else (s[0], len(s[1])) for s in trace]
