"""The pooling runners driven by hand-built scheduler outputs (no engine): an encoder's step of
requests of different lengths, packed into encode buckets, each pooled as vLLM's parameters
say; a request the model cannot serve fails alone; a decoder's prompt pooled across chunks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.pooling_params import PoolingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models.pooling import Pooling, pool
from vllm_aot.plugin.pooling import DecoderPoolingRunner, PoolingRunner
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.encode_inputs import EncoderSequence
from vllm_aot.runtime.inputs import PrefillChunk


@pytest.fixture(scope="module")
def model(embedding_model_dir):
    shapes = {"max_model_len": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    config = RuntimeConfig(runner="pooling", dtype="float32", backend="eager", **shapes)
    return load_model(embedding_model_dir, config)[0]


def new_request(req_id: str, token_ids: list[int], **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=token_ids,
        mm_features=[],
        sampling_params=None,
        pooling_params=PoolingParams(task="embed", **params),
        block_ids=([],),
        num_computed_tokens=0,
        lora_request=None,
    )


def step(*requests: NewRequestData) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    num_tokens = {r.req_id: len(r.prompt_token_ids) for r in requests}
    return dataclasses.replace(
        out,
        scheduled_new_reqs=list(requests),
        num_scheduled_tokens=num_tokens,
        total_num_scheduled_tokens=sum(num_tokens.values()),
    )


def test_a_step_of_requests_is_encoded_and_pooled_each_as_asked(model):
    runner = PoolingRunner(model, "MEAN")
    lengths = [40, 3, 30, 12]  # 85 tokens: two encode steps of at most 64
    token_ids = [[101, *range(2000, 2000 + n - 2), 102] for n in lengths]
    requests = [new_request(f"r{i}", ids, use_activation=i != 1) for i, ids in enumerate(token_ids)]
    output = runner.execute_model(step(*requests))
    assert output.req_ids == ["r0", "r1", "r2", "r3"]
    assert output.sampled_token_ids == [[], [], [], []]
    for i, ids in enumerate(token_ids):
        expected = model.embed([EncoderSequence(ids)], Pooling("MEAN", normalize=i != 1))[0]
        torch.testing.assert_close(output.pooler_output[i], expected, atol=1e-5, rtol=1e-5)
    assert output.pooler_output[1].norm() != pytest.approx(1.0)  # use_activation=False


def test_sentence_pairs_get_their_token_types(model):
    runner = PoolingRunner(model, "CLS")
    ids = [101, 2023, 102, 2008, 102]
    pair = new_request("pair", ids, extra_kwargs={"compressed_token_type_ids": 3})
    output = runner.execute_model(step(pair, new_request("one", ids)))
    expected = model.embed([EncoderSequence(ids, [0, 0, 0, 1, 1])], Pooling("CLS", True))[0]
    torch.testing.assert_close(output.pooler_output[0], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(output.pooler_output[0], output.pooler_output[1], atol=1e-3)


def test_a_request_the_model_cannot_serve_fails_alone(model):
    runner = PoolingRunner(model, "MEAN")
    bad = new_request("bad", [101, 40_000, 102])
    output = runner.execute_model(step(new_request("good", [101, 2023, 102]), bad))
    assert output.pooler_output[0] is not None and output.pooler_output[1] is None
    assert "outside the vocabulary (0..30521)" in output.failed_requests["bad"]


def continued(req_id: str, num_computed: int, num_tokens: int) -> SchedulerOutput:
    """A step with one earlier request's next chunk (its blocks were all given at first)."""
    out = SchedulerOutput.make_empty()
    cached = dataclasses.replace(
        out.scheduled_cached_reqs,
        req_ids=[req_id],
        new_block_ids=[None],
        num_computed_tokens=[num_computed],
        num_output_tokens=[0],
    )
    return dataclasses.replace(
        out,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: num_tokens},
        total_num_scheduled_tokens=num_tokens,
    )


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_a_decoders_chunks_are_pooled_across_steps(tiny_model_dir, kind):
    """--convert embed: a 90-token prompt over two steps (the first shared with a whole short
    prompt) pools as the whole prompt in one step does."""
    config = tiny_config(runner="pooling", convert="embed", max_num_batched_tokens=128)
    model = load_model(tiny_model_dir, config)[0]
    long, short = list(range(1000, 1090)), list(range(2000, 2010))
    runner = DecoderPoolingRunner(model, kind)
    first = dataclasses.replace(
        step(new_request("long", long), new_request("short", short)),
        num_scheduled_tokens={"long": 50, "short": 10},
        total_num_scheduled_tokens=60,
    )
    first.scheduled_new_reqs[0].block_ids = ([1, 2, 3, 4, 5, 6],)
    first.scheduled_new_reqs[1].block_ids = ([7],)
    output = runner.execute_model(first)
    assert output.pooler_output[0] is None and output.pooler_output[1] is not None
    output = runner.execute_model(continued("long", 50, 40))
    assert output.req_ids == ["long"] and runner.requests == {}
    whole = model.prefill_states([PrefillChunk(long, 0, [8, 9, 10, 11, 12, 13])])[0]
    expected = pool(whole, Pooling(kind, normalize=True))
    torch.testing.assert_close(output.pooler_output[0], expected, atol=1e-5, rtol=1e-5)
