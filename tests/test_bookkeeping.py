"""The runners' per-request bookkeeping (`plugin/bookkeeping.py`) driven by hand-built scheduler
outputs, no model: states added, updated, resumed and forgotten as vLLM's scheduler says; a
request that fails ends alone, while fatal failures propagate."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import pytest
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_aot.plugin.bookkeeping import RequestRunner
from vllm_aot.plugin.faults import RequestError

pytestmark = pytest.mark.unit


@dataclass
class Entry:
    prompt: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_resumed: int = 0


class Ledger(RequestRunner[Entry]):
    """A runner that keeps an `Entry` per request; a prompt starting with a negative id cannot
    be served, one starting with 999 breaks an invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.forgotten: list[str] = []

    def admit(self, new: NewRequestData) -> Entry:
        first = new.prompt_token_ids[0]
        if first < 0:
            raise RequestError(f"token id {first} is outside the vocabulary")
        assert first != 999, "a broken invariant"
        return Entry(list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens)

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        self.forgotten.append(req_id)

    def update(self, req_id: str, state: Entry, cached: CachedRequestData, i: int) -> None:
        super().update(req_id, state, cached, i)
        state.num_resumed += req_id in cached.resumed_req_ids


def new(req_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=(blocks,),
        num_computed_tokens=0,
        lora_request=None,
    )


def step(
    new_reqs=(), cached: dict[str, tuple[list[int] | None, int]] | None = None, *,
    resumed=(), finished=(),
) -> SchedulerOutput:  # fmt: skip
    """A scheduler output: `cached` maps req_id -> (new block ids or None, computed tokens)."""
    cached = cached or {}
    data = CachedRequestData(
        req_ids=list(cached),
        resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in cached],
        all_token_ids={},
        new_block_ids=[None if b is None else (b,) for b, _ in cached.values()],
        num_computed_tokens=[n for _, n in cached.values()],
        num_output_tokens=[0 for _ in cached],
    )
    return dataclasses.replace(
        SchedulerOutput.make_empty(),
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=data,
        finished_req_ids=set(finished),
    )


def test_states_follow_the_scheduler_from_arrival_to_finish():
    """New requests are admitted with their blocks; later steps append blocks and move the
    computed tokens; a resumed request gets its fresh blocks instead; finished ones are
    forgotten; an update for a request no longer known (failed a step before) is skipped."""
    ledger = Ledger()
    assert ledger.update_states(step([new("a", [1, 2, 3], [4]), new("b", [5], [6])])) == {}
    assert ledger.requests["a"] == Entry([1, 2, 3], [4], 0)
    ledger.update_states(step(cached={"a": ([7], 3), "b": (None, 1), "gone": ([8], 9)}))
    assert ledger.requests["a"] == Entry([1, 2, 3], [4, 7], 3)
    assert ledger.requests["b"] == Entry([5], [6], 1) and "gone" not in ledger.requests
    ledger.update_states(step(cached={"a": ([9, 10], 0)}, resumed={"a"}))
    assert ledger.requests["a"] == Entry([1, 2, 3], [9, 10], 0, num_resumed=1)
    ledger.update_states(step(cached={"b": (None, 2)}, finished={"a"}))
    assert list(ledger.requests) == ["b"] and ledger.forgotten == ["a"]
    ledger.update_states(step(finished={"b", "never-admitted"}))
    assert ledger.requests == {}


def test_a_new_request_that_cannot_be_served_fails_alone(caplog):
    """Bad input (RequestError) and an unexpected error while admitting one request each end
    that request: reported with the reason, forgotten, logged (a traceback only for the
    unexpected one); the requests beside them are admitted."""

    class Flaky(Ledger):
        def admit(self, new: NewRequestData) -> Entry:
            if new.req_id == "flaky":
                raise OSError("the disk went away")
            return super().admit(new)

    ledger = Flaky()
    requests = [
        new("a", [1], [1]),
        new("bad", [-3], [2]),
        new("flaky", [1], [3]),
        new("b", [2], [4]),
    ]
    logger = logging.getLogger("vllm.vllm_aot.plugin.bookkeeping")
    logger.addHandler(caplog.handler)  # vLLM's loggers may not propagate to the root's
    try:
        failed = ledger.update_states(step(requests))
    finally:
        logger.removeHandler(caplog.handler)
    assert failed == {
        "bad": "token id -3 is outside the vocabulary",
        "flaky": "OSError: the disk went away",
    }
    assert list(ledger.requests) == ["a", "b"] and ledger.forgotten == ["bad", "flaky"]
    tracebacks = {r.getMessage().split()[2]: r.exc_info is not None for r in caplog.records}
    assert tracebacks == {"bad": False, "flaky": True}


def test_a_step_failure_ends_its_one_request_and_a_shared_or_broken_one_the_engine():
    """`fail`: a step of one request that raises ends that request (forgotten, recorded); bad
    input ends every request it concerns; an unexpected error shared by two requests, or a
    broken invariant, propagates."""
    ledger = Ledger()
    ledger.update_states(step([new(r, [1], [i]) for i, r in enumerate("abcd")]))
    failed: dict[str, str] = {}
    ledger.fail(RuntimeError("one row's host-side processing"), ["a"], failed)
    ledger.fail(RequestError("bad grammar"), ["b", "c"], failed)
    assert failed == {
        "a": "RuntimeError: one row's host-side processing",
        "b": "bad grammar",
        "c": "bad grammar",
    }
    assert list(ledger.requests) == ["d"]
    with pytest.raises(RuntimeError, match="a batch's program"):
        ledger.fail(RuntimeError("a batch's program"), ["d", "e"], failed)
    with pytest.raises(AssertionError):
        ledger.fail(AssertionError("runner state"), ["d"], failed)
    with pytest.raises(AssertionError, match="a broken invariant"):
        ledger.update_states(step([new("e", [999], [5])]))
    assert list(ledger.requests) == ["d"] and len(failed) == 3


def test_every_runner_keeps_its_requests_this_way():
    from vllm_aot.plugin.pooling import DecoderPoolingRunner, PoolingRunner
    from vllm_aot.plugin.runner import AotModelRunner

    for runner in (AotModelRunner, PoolingRunner, DecoderPoolingRunner):
        assert issubclass(runner, RequestRunner), runner
