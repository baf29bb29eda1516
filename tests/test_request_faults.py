"""A request that fails ends alone: vLLM's engine loop in-process (tests/engine_loop.py) with
AotScheduler and our runner over the tiny model (eager), no worker process.

Each poison request finishes with vLLM's FinishReason.ERROR (HTTP 500 for that request) while
the requests around it get all their tokens and every KV block comes back; failures shared by
several requests, and broken invariants, still stop the engine (`plugin/faults.py`).
"""

from __future__ import annotations

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request

from tests.engine_loop import (
    NUM_BLOCKS,
    AsyncEngineLoop,
    Engine,
    make_block_hasher,
    make_request,
    make_scheduler,
)
from vllm_aot.plugin import logits as logits_module
from vllm_aot.plugin.faults import RequestError, is_per_request
from vllm_aot.plugin.runner import AotModelRunner

pytestmark = pytest.mark.unit

MAX_TOKENS = 5
VOCAB_SIZE = 49152  # the tiny model's


@pytest.fixture(params=["sync", "async"])
def engine(request, loop_vllm_config, loop_model):
    """The engine loop as it runs without and with --async-scheduling."""
    is_async = request.param == "async"
    scheduler = make_scheduler(loop_vllm_config, NUM_BLOCKS, is_async=is_async)
    runner = AotModelRunner(loop_model)
    loop = AsyncEngineLoop(scheduler, runner) if is_async else None
    yield Engine(scheduler, runner, make_block_hasher(loop_vllm_config), MAX_TOKENS, loop)
    if loop is not None:
        loop.shutdown()
    scheduler.shutdown()


def assert_served_around(engine: Engine, poison: str, others: list[str], free_before: int):
    """The poison request failed with nothing sampled; the others got every token."""
    assert engine.finished[poison] is FinishReason.ERROR
    assert engine.tokens[poison] == []
    for req_id in others:
        assert engine.finished[req_id] is FinishReason.LENGTH, req_id
        assert len(engine.tokens[req_id]) == MAX_TOKENS, req_id
    assert engine.num_free_blocks == free_before, "blocks leaked"
    engine.step()  # the finished ids reach the runner with the next step, as in EngineCore
    assert not engine.runner.requests


POISONS = {
    # the front end checks token ids against its tokenizer, skipped by --skip-tokenizer-init
    "token_outside_the_vocabulary": ([5, VOCAB_SIZE + 10, 7], {}),
    # what --max-logprobs -1 let through before the platform capped it at the head's 20
    "more_logprobs_than_the_head": (12, {"logprobs": 50}),
    "logprobs_of_the_whole_vocabulary": (12, {"logprobs": -1}),
    "more_prompt_logprobs_than_the_head": (12, {"prompt_logprobs": 50}),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_request_the_model_cannot_serve_fails_alone(engine, poison):
    free_before = engine.num_free_blocks
    prompt, params = POISONS[poison]
    engine.add("A", 40)
    engine.step(2)  # A decoding when the poison arrives
    engine.add("P", prompt, **params)
    engine.add("B", 20)
    engine.run()
    assert_served_around(engine, "P", ["A", "B"], free_before)


def test_prompt_embeddings_of_the_wrong_hidden_size_fail_alone(engine):
    """The tiny model's hidden size is 64; vLLM's offline path does not check it."""
    free_before = engine.num_free_blocks
    engine.add("A", 40)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    embeds = Request("P", None, params, None, prompt_embeds=torch.zeros(12, 48))
    engine.scheduler.add_request(embeds)
    engine.run()
    assert_served_around(engine, "P", ["A"], free_before)


def test_a_failed_prefill_leaves_nothing_in_the_prefix_cache(engine, loop_model, monkeypatch):
    """The second chunk of a 100-token prompt fails: the request ends, A goes on, and a later
    request with the same prompt finds none of the failed request's blocks cached."""
    prefill = loop_model.forward_prefill
    calls = []

    def second_chunk_fails(chunks):
        calls.append(chunks)
        if len(calls) == 3:  # A's prompt, P's first chunk, P's second chunk
            raise RuntimeError("planted failure")
        return prefill(chunks)

    monkeypatch.setattr(loop_model, "forward_prefill", second_chunk_fails)
    free_before = engine.num_free_blocks
    engine.add("A", 20)
    engine.step()
    poison = engine.add("P", 100)
    engine.run()
    assert_served_around(engine, "P", ["A"], free_before)

    again = make_request("Q", poison.prompt_token_ids, engine.block_hasher, poison.sampling_params)
    num_cached_tokens = engine.scheduler.kv_cache_manager.get_computed_blocks(again)[1]
    assert num_cached_tokens == 0


def test_host_side_processing_failure_ends_its_row_alone(engine, monkeypatch):
    """B's penalty processing fails on its third token; A, decoding beside it, is untouched."""
    process_logits = logits_module.process_logits
    calls = []

    def third_call_fails(logits, request):
        calls.append(request.req_id)
        if len(calls) == 3:
            raise RuntimeError("planted failure")
        return process_logits(logits, request)

    monkeypatch.setattr(logits_module, "process_logits", third_call_fails)
    engine.add("A", 20)
    engine.add("B", 20, repetition_penalty=1.5)
    engine.run()
    assert engine.finished["B"] is FinishReason.ERROR
    assert len(engine.tokens["B"]) == 2
    assert engine.finished["A"] is FinishReason.LENGTH
    assert len(engine.tokens["A"]) == MAX_TOKENS


def test_a_failure_shared_by_a_batch_stops_the_engine(engine, loop_model, monkeypatch):
    """A decode program failing for two rows cannot be blamed on one request: it propagates."""

    def decode_fails(rows):
        raise RuntimeError("planted failure")

    engine.add("A", 20)
    engine.add("B", 20)
    engine.step(2)  # both prompts scheduled
    monkeypatch.setattr(loop_model, "forward_decode", decode_fails)
    with pytest.raises(RuntimeError, match="planted failure"):
        engine.run()


@pytest.mark.parametrize(
    ("exc", "num_requests", "is_theirs"),
    [
        (RequestError("bad input"), 3, True),
        (RuntimeError("program failed"), 1, True),
        (RuntimeError("program failed"), 2, False),
        (AssertionError("broken invariant"), 1, False),
        (MemoryError(), 1, False),
        (KeyboardInterrupt(), 1, False),
    ],
)
def test_failures_are_classified_in_one_place(exc, num_requests, is_theirs):
    assert is_per_request(exc, num_requests) is is_theirs
