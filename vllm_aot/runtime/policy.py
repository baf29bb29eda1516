"""The scheduling policy: what one step runs, decided in one place for every driver.

A static-shape backend runs prefill and decode as different programs, so a step is one or the
other, never mixed:

- a prompt in flight (`is_prefilling`) runs alone, one chunk per step (`next_chunk`);
- otherwise the oldest waiting request is released, alone, if `can_admit` allows it; its first
  chunk is the step;
- otherwise every running request decodes one token (no request running: an empty step).

Admission is by worst case, so nothing is ever preempted: fewer than `max_num_seqs` rows run,
and the KV blocks of every running request's worst case plus the candidate's fit the pool.

Drivers: the runtime's generate loop and teacher forcing (through
`runtime/local_scheduler.py`, which owns their queues and KV blocks), and vLLM's scheduler
(through `plugin/scheduler.py`, which keeps vLLM's waiting queue and grammar readiness). They
hand `schedule` their running and waiting requests; anything with the `RequestView` attributes
will do, vLLM's `Request` and the runtime's `RequestState` as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.kv_cache import blocks_needed


class RequestView(Protocol):
    """What the policy reads of a request."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...  # prompt and generated tokens known so far

    @property
    def num_computed_tokens(self) -> int: ...  # tokens whose K/V are in the cache

    @property
    def max_tokens(self) -> int: ...  # tokens it may generate


R = TypeVar("R", bound=RequestView)


@dataclass(frozen=True)
class Limits:
    """The numbers admission and chunking obey."""

    max_num_seqs: int  # rows running at once
    max_model_len: int  # tokens of one request, prompt and generated
    block_size: int  # tokens per KV block
    num_usable_blocks: int  # KV blocks requests may hold (the pool less its reserved block 0)
    max_num_batched_tokens: int  # tokens of one prefill chunk
    num_lookahead_tokens: int = 0  # drafts a step may compute past the newest token

    @classmethod
    def of(cls, config: RuntimeConfig, num_kv_blocks: int) -> Limits:
        """A runtime config's limits over a pool of `num_kv_blocks` (block 0 is the dummy)."""
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            block_size=config.block_size,
            num_usable_blocks=num_kv_blocks - 1,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_lookahead_tokens=config.num_speculative_tokens,
        )


class StepKind(Enum):
    PREFILL = "prefill"  # the next chunk of the one prompt in flight
    RELEASE = "release"  # the oldest waiting request starts running: its first chunk
    DECODE = "decode"  # one token for every running request


@dataclass(frozen=True)
class Step(Generic[R]):
    kind: StepKind
    requests: tuple[R, ...]  # PREFILL, RELEASE: the one request; DECODE: every running one


def is_prefilling(request: RequestView) -> bool:
    """Prompt tokens are still to be computed, or more than the one newest token.

    Checking the prompt matters when exactly one prompt token is left (a 65-token prompt after a
    64-token chunk): that step computes a prompt position, so it is a prefill and runs alone,
    never batched with decodes.
    """
    return (
        request.num_computed_tokens < request.num_prompt_tokens
        or request.num_tokens - request.num_computed_tokens > 1
    )


def next_chunk(request: RequestView, limits: Limits) -> range:
    """Positions the request's next prefill step computes (the runtime's drivers cut here;
    in serving vLLM's scheduler cuts within the same `max_num_batched_tokens`)."""
    start = request.num_computed_tokens
    return range(start, min(request.num_tokens, start + limits.max_num_batched_tokens))


def worst_case_blocks(request: RequestView, limits: Limits) -> int:
    """KV blocks of the request at its longest: prompt + max_tokens (+ the drafts its last step
    may verify), capped at max_model_len."""
    longest = request.num_prompt_tokens + request.max_tokens + limits.num_lookahead_tokens
    num_tokens = min(longest, limits.max_model_len)
    return blocks_needed(num_tokens, limits.block_size)


def can_admit(candidate: RequestView, running: Sequence[RequestView], limits: Limits) -> bool:
    """A row is free and every running request's worst case plus the candidate's fits."""
    if len(running) >= limits.max_num_seqs:
        return False
    reserved = sum(worst_case_blocks(r, limits) for r in running)
    return reserved + worst_case_blocks(candidate, limits) <= limits.num_usable_blocks


def schedule(running: Sequence[R], waiting: Sequence[R], limits: Limits) -> Step[R]:
    """The next step. `waiting`: the requests that could start now, in arrival order."""
    prefilling = [r for r in running if is_prefilling(r)]
    if prefilling:
        return Step(StepKind.PREFILL, (prefilling[0],))
    if waiting and can_admit(waiting[0], running, limits):
        return Step(StepKind.RELEASE, (waiting[0],))
    return Step(StepKind.DECODE, tuple(running))
