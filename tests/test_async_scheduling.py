"""Async scheduling gives what synchronous scheduling gives: vLLM's engine loop in-process
(tests/engine_loop.py) over the tiny model, once stepping synchronously and once with two steps
in flight and the runner on its own thread (`plugin/async_steps.py`).

Same arrivals, same steps of the policy, so the same tokens: greedy and seeded sampling, prompts
of one and several chunks, requests arriving while others decode, max_tokens of one, and an
abort that lands between steps (the aborted request gets nothing after it, the others all).
"""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.engine_loop import (
    NUM_BLOCKS,
    AsyncEngineLoop,
    Engine,
    make_block_hasher,
    make_scheduler,
)
from vllm_aot.plugin.runner import AotModelRunner

MAX_TOKENS = 12

# (arrival step, request id, prompt tokens, sampling parameters)
ARRIVALS = [
    (0, "greedy", 20, {}),
    (0, "seeded", 33, {"temperature": 0.9, "top_p": 0.9, "seed": 7}),
    (2, "two-chunks", 100, {}),
    (3, "one-token", 9, {"max_tokens": 1}),
    (5, "late", 70, {"temperature": 0.7, "top_k": 20, "seed": 3, "max_tokens": 20}),
    (6, "penalised", 15, {"repetition_penalty": 1.3}),
]


@pytest.fixture
def make_engine(loop_vllm_config, loop_model):
    made = []

    def make(is_async: bool) -> Engine:
        scheduler = make_scheduler(loop_vllm_config, NUM_BLOCKS, is_async=is_async)
        runner = AotModelRunner(loop_model)
        loop = AsyncEngineLoop(scheduler, runner) if is_async else None
        engine = Engine(scheduler, runner, make_block_hasher(loop_vllm_config), MAX_TOKENS, loop)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.async_loop is not None:
            engine.async_loop.shutdown()
        engine.scheduler.shutdown()


def serve(engine: Engine, abort: tuple[int, str] | None = None) -> None:
    """ARRIVALS in their steps (an engine step each), `abort` = (step, id) likewise, then
    every request to its end."""
    for step in range(8):
        for at, req_id, prompt, params in ARRIVALS:
            if at == step:
                engine.add(req_id, prompt, **params)
        if abort is not None and abort[0] == step:
            engine.scheduler.finish_requests(abort[1], RequestStatus.FINISHED_ABORTED)
        engine.step()
    engine.run(max_steps=200)


def test_async_outputs_equal_sync(make_engine):
    sync, async_ = make_engine(is_async=False), make_engine(is_async=True)
    free_before = async_.num_free_blocks
    serve(sync)
    serve(async_)
    assert dict(async_.tokens) == dict(sync.tokens)
    assert async_.finished == sync.finished
    assert len(async_.tokens["one-token"]) == 1
    assert len(async_.tokens["late"]) == 20
    assert all(len(async_.tokens[r]) == MAX_TOKENS for r in ("greedy", "seeded", "two-chunks"))
    assert async_.num_free_blocks == free_before, "blocks leaked"
    async_.step()  # the finished ids reach the runner with the next step
    assert not async_.runner.requests


def test_an_abort_lands_exactly_under_async(make_engine):
    """ "greedy" is aborted after a few of its tokens: it gets a prefix of its full answer and
    nothing after the abort; everyone else gets what they get without the abort."""
    full, aborted = make_engine(is_async=False), make_engine(is_async=True)
    serve(full)
    serve(aborted, abort=(6, "greedy"))
    got = aborted.tokens["greedy"]
    assert 0 < len(got) < MAX_TOKENS
    assert got == full.tokens["greedy"][: len(got)]
    assert "greedy" not in aborted.finished  # an abort comes from the front end, not an output
    for req_id in full.tokens:
        if req_id != "greedy":
            assert aborted.tokens[req_id] == full.tokens[req_id], req_id
            assert aborted.finished[req_id] is FinishReason.LENGTH
    aborted.step()
    assert not aborted.runner.requests
