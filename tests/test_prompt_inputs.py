"""Prompt logprobs and prompt embeddings on the tiny model (eager, float32): the runtime's head
over prompt positions and its embedding inputs, then vLLM's engine loop in-process
(tests/engine_loop.py: AotScheduler and our runner, no worker process)."""

from __future__ import annotations

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request

from tests.engine_loop import (
    engine_step,
    make_block_hasher,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from tests.helpers import tiny_config
from vllm_aot.accuracy.logit_tolerance import DEFAULT_TOLERANCES
from vllm_aot.accuracy.teacher_forcing import HFReference, our_logits
from vllm_aot.loading.startup import load_model
from vllm_aot.plugin.runner import AotModelRunner
from vllm_aot.runtime.inputs import PrefillChunk

NUM_BLOCKS = 65
PROMPT = [(97 * i + 13) % 40000 + 100 for i in range(150)]  # three chunks of <= 64 tokens


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    config = tiny_config(num_kv_blocks=NUM_BLOCKS)
    return load_model(tiny_model_dirs("llama"), config, show_progress=False)[0]


def test_scored_tokens_have_the_logprobs_of_the_logits(model):
    """`score` forces each row's token through the greedy head; its logprob, rank and top-n are
    the log-softmax of the same rows' logits."""
    ids = PROMPT[:40]
    chunk = PrefillChunk(ids, 0, [1, 2, 3])
    logprobs = torch.log_softmax(model.prefill_logits(chunk), dim=-1)[:-1]
    out = model.score(model.forward_prefill([chunk]).tokens[:-1], ids[1:])
    targets = torch.tensor(ids[1:])
    assert out.tokens.tolist() == ids[1:]
    expected = logprobs.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(out.token_logprobs, expected, atol=1e-5, rtol=0)
    assert out.token_ranks.tolist() == (logprobs >= expected[:, None]).sum(-1).tolist()
    top = logprobs.topk(out.top_ids.shape[1], dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values, atol=1e-5, rtol=0)


def test_the_model_own_embeddings_as_inputs_give_the_token_prompt_logits(model):
    ids = PROMPT[:40]
    embeds = model.embed(torch.tensor(ids))
    by_tokens = model.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3]))
    by_embeds = model.prefill_logits(PrefillChunk([0] * len(ids), 0, [1, 2, 3], embeds))
    torch.testing.assert_close(by_embeds, by_tokens, atol=0, rtol=0)


# -- vLLM's engine loop ---------------------------------------------------------------------


class Engine:
    def __init__(self, vllm_config, model) -> None:
        self.scheduler = make_scheduler(vllm_config, NUM_BLOCKS)
        self.runner = AotModelRunner(model)
        self.block_hasher = make_block_hasher(vllm_config)
        self.outputs: dict[str, list] = {}

    def add(self, req_id: str, prompt=None, *, embeds=None, is_token_ids=None, **params):
        """A request of `prompt` (a length or token ids), or of `embeds` (with `prompt` token
        ids where `is_token_ids`: a mixed prompt)."""
        params = SamplingParams(**({"max_tokens": 6, "temperature": 0} | params))
        if embeds is None:
            request = make_request(req_id, prompt, self.block_hasher, params)
        else:
            request = Request(
                req_id,
                prompt,
                params,
                None,
                prompt_embeds=embeds,
                prompt_is_token_ids=is_token_ids,
                block_hasher=self.block_hasher,
            )
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.scheduler.get_num_unfinished_requests():
                return
            for out in engine_step(self.scheduler, self.runner):
                self.outputs[out.request_id].append(out)
        raise AssertionError("requests never finished")

    def tokens(self, req_id: str) -> list[int]:
        return [t for out in self.outputs[req_id] for t in out.new_token_ids]

    def finish_reason(self, req_id: str):
        return self.outputs[req_id][-1].finish_reason


@pytest.fixture
def engine(tiny_model_dirs, model):
    engine = Engine(make_vllm_config(tiny_model_dirs("llama")), model)
    yield engine
    engine.scheduler.shutdown()


def test_prompt_logprobs_across_chunks_are_the_teacher_forced_ones(engine, model, tiny_model_dirs):
    """A 150-token prompt prefilled in three chunks beside a decoding request: one table of
    149 rows (none for the first token), in the step that ends the prompt, equal to the
    log-softmax of the teacher-forced logits (ours to float32 rounding, HF's within the
    accuracy module's top-5 tolerance)."""
    engine.add("A", 20, max_tokens=30)
    engine.add("P", PROMPT, prompt_logprobs=5, max_tokens=3)
    engine.run()
    tables = [o.new_prompt_logprobs_tensors for o in engine.outputs["P"]]
    assert tables[0] is not None and all(t is None for t in tables[1:])
    ids, values, ranks = tables[0][:3]
    assert ids.shape == values.shape == (len(PROMPT) - 1, 6)
    assert ids[:, 0].tolist() == PROMPT[1:]
    assert len(engine.tokens("A")) == 30

    ours = torch.log_softmax(our_logits(model, PROMPT)[:-1], dim=-1)
    torch.testing.assert_close(values, ours.gather(1, ids.long()), atol=1e-4, rtol=0)
    # a rank counts the logprobs at least the token's: equal up to ties within rounding
    at_most = (ours >= values[:, :1] - 1e-5).sum(-1)
    at_least = (ours >= values[:, :1] + 1e-5).sum(-1)
    assert ((at_least <= ranks) & (ranks <= at_most)).all()

    hf_logits = HFReference(tiny_model_dirs("llama")).logits(PROMPT)[:-1]
    reference = torch.log_softmax(hf_logits, dim=-1)
    tolerance = DEFAULT_TOLERANCES[5]
    bound = tolerance.atol + tolerance.rtol * hf_logits.abs().amax(-1, keepdim=True)
    assert ((values - reference.gather(1, ids.long())).abs() <= bound).all()
    assert (ids[:, 1:].long() == reference.topk(5, dim=-1).indices).float().mean() > 0.99


def test_prompt_logprobs_of_a_cached_prompt_score_every_position(engine, model):
    """vLLM's requests with prompt logprobs skip reading the prefix cache: a prompt served just
    before is computed again, and every position is scored."""
    prompt = PROMPT[:40]
    engine.add("T", prompt)
    engine.run()
    engine.add("P", prompt, prompt_logprobs=1)
    engine.run()
    table = engine.outputs["P"][0].new_prompt_logprobs_tensors
    expected = torch.log_softmax(our_logits(model, prompt)[:-1], dim=-1)
    wanted = expected.gather(1, torch.tensor(prompt[1:])[:, None])
    torch.testing.assert_close(table.logprobs[:, :1], wanted, atol=1e-4, rtol=0)


def test_a_one_token_prompt_has_no_prompt_logprobs(engine):
    engine.add("P", [504], prompt_logprobs=2)
    engine.run()
    table = engine.outputs["P"][0].new_prompt_logprobs_tensors
    assert table.logprobs.shape == (0, 3)
    assert len(engine.tokens("P")) == 6


def test_prompt_logprobs_beyond_the_head_fail_alone(engine):
    engine.add("A", 30)
    engine.add("P", 12, prompt_logprobs=50)
    engine.run()
    assert engine.finish_reason("P") is FinishReason.ERROR
    assert len(engine.tokens("A")) == 6


def test_a_prompt_given_as_its_embeddings_generates_the_token_prompt_text(engine, model):
    """The embeddings request is prefilled in chunks (100 tokens) and decodes in one batch with
    token prompts; its greedy tokens are those of the same prompt as token ids."""
    prompt = PROMPT[:100]
    embeds = model.embed(torch.tensor(prompt))
    engine.add("T", prompt, max_tokens=12)
    engine.add("A", 30, max_tokens=12)
    engine.add("E", embeds=embeds, max_tokens=12)
    engine.run()
    assert len(engine.tokens("E")) == 12
    assert engine.tokens("E") == engine.tokens("T")


def test_a_prompt_mixing_token_ids_and_embeddings_generates_the_token_prompt_text(engine, model):
    """Chat content parts: positions 10..29 given as embeddings (their ids a placeholder outside
    the vocabulary, as vLLM's renderer sends them), the rest as token ids."""
    prompt = PROMPT[:60]
    is_token_ids = [not 10 <= i < 30 for i in range(60)]
    ids = [t if is_token else 49152 for t, is_token in zip(prompt, is_token_ids, strict=True)]
    embeds = torch.zeros(60, 64)
    embeds[10:30] = model.embed(torch.tensor(prompt[10:30]))
    engine.add("T", prompt, max_tokens=12)
    engine.add("M", ids, embeds=embeds, is_token_ids=is_token_ids, max_tokens=12)
    engine.run()
    assert len(engine.tokens("M")) == 12
    assert engine.tokens("M") == engine.tokens("T")


def test_repeated_embeddings_hit_the_prefix_cache_and_generate_the_same(engine, model):
    """vLLM hashes an embeddings prompt's blocks with its embeddings: the same ones again
    start from cached blocks; the first chunk after them reads them."""
    embeds = model.embed(torch.tensor(PROMPT[:100]))
    engine.add("E1", embeds=embeds, max_tokens=8)
    engine.run()
    again = engine.add("E2", embeds=embeds.clone(), max_tokens=8)
    num_cached = engine.scheduler.kv_cache_manager.get_computed_blocks(again)[1]
    assert num_cached == 96  # whole blocks of 16
    engine.run()
    assert engine.tokens("E2") == engine.tokens("E1")
    other = engine.add("E3", embeds=embeds + 0.01, max_tokens=8)  # same length, no hit
    assert engine.scheduler.kv_cache_manager.get_computed_blocks(other)[1] == 0


@pytest.mark.parametrize(
    "embeds",
    [torch.zeros(12, 32), torch.full((12, 64), float("nan"))],
    ids=["hidden_size", "nan"],
)
def test_embeddings_the_model_cannot_take_fail_alone(engine, embeds):
    engine.add("A", 30)
    engine.add("E", embeds=embeds)
    engine.run()
    assert engine.finish_reason("E") is FinishReason.ERROR
    assert len(engine.tokens("A")) == 6
