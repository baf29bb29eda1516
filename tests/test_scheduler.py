"""AotScheduler without a device or worker: hand-built requests, a fabricated runner.

Which steps run is the policy's (`tests/test_policy.py`); here vLLM's scheduler is checked to
take exactly those steps for the same arrivals, and for what is vLLM's own: requests held in
its waiting queue, blocks freed on finish and abort, prefix-cache hits, grammar readiness.

Each step is scheduled, answered the way our runner answers (a token for a row that reaches the
end of its request's known tokens, nothing for a prefill chunk that does not), and fed back with
`update_from_output`. What a row *is* follows the runner too: a decode row is one token at or
past the end of the prompt; everything else is a prefill row, and a step never mixes the two.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

from tests import engine_loop
from tests.engine_loop import make_block_hasher, make_vllm_config
from tests.policy_trace import BLOCK_SIZE, SCENARIOS, TraceStep, simulate
from vllm_aot.plugin.scheduler import AotScheduler, Gathering, batch_of

pytestmark = pytest.mark.unit

SAMPLED = 7  # the token our fake runner always samples (no EOS is set, so never a stop)


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dirs) -> VllmConfig:
    """One config for the module (it goes through AotPlatform.check_and_update_config)."""
    return make_vllm_config(tiny_model_dirs("llama"))


@pytest.fixture
def make_scheduler(vllm_config):
    """Fresh AotScheduler over a pool of `num_blocks` KV blocks (block 0 is vLLM's null block)."""
    made: list[AotScheduler] = []

    def make(num_blocks: int = 65) -> AotScheduler:
        made.append(engine_loop.make_scheduler(vllm_config, num_blocks))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.shutdown()


@pytest.fixture
def make_request(vllm_config):
    """Request with a random prompt (seeded by its id) or the given prompt token ids."""
    block_hasher = make_block_hasher(vllm_config)

    def make(
        req_id: str,
        prompt: int | list[int],
        max_tokens: int = 4,
        structured: StructuredOutputsParams | None = None,
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=structured)
        return engine_loop.make_request(req_id, prompt, block_hasher, params)

    return make


@dataclass
class Step:
    """One engine step as the runner and the front end would see it."""

    output: SchedulerOutput
    prefill: list[str] = field(default_factory=list)  # rows run by a prefill program
    decode: list[str] = field(default_factory=list)  # rows run by the decode program
    finished: list[str] = field(default_factory=list)  # finished in this step's update
    running: set[str] = field(default_factory=set)  # scheduler.running when it was scheduled

    @property
    def scheduled(self) -> list[str]:
        return list(self.output.num_scheduled_tokens)


def run_step(scheduler: AotScheduler) -> Step:
    """schedule() → answer like our runner → update_from_output()."""
    output = scheduler.schedule()
    step = Step(output, running={r.request_id for r in scheduler.running})
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        num = output.num_scheduled_tokens[req_id]
        start = request.num_computed_tokens - num  # schedule() already advanced it
        complete = start + num == request.num_tokens  # reaches the end: a token is sampled
        is_decode = num == 1 and complete and start >= request.num_prompt_tokens
        (step.decode if is_decode else step.prefill).append(req_id)
        sampled.append([SAMPLED] if complete else [])
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    engine_outputs = scheduler.update_from_output(output, runner_output)
    step.finished = [
        out.request_id
        for outputs in engine_outputs.values()
        for out in outputs.outputs
        if out.finish_reason is not None
    ]
    return step


def run_all(scheduler: AotScheduler, max_steps: int = 1000) -> list[Step]:
    steps = []
    while scheduler.get_num_unfinished_requests():
        assert len(steps) < max_steps, "requests never finished"
        steps.append(run_step(scheduler))
    return steps


def assert_never_mixed(steps: list[Step]) -> None:
    for i, step in enumerate(steps):
        assert not (step.prefill and step.decode), f"step {i} mixes {step.prefill} {step.decode}"
        assert len(step.prefill) <= 1, f"step {i} runs several prefills: {step.prefill}"


def trace_of(step: Step) -> TraceStep:
    if step.prefill:
        (req_id,) = step.prefill
        return ("prefill", req_id, step.output.num_scheduled_tokens[req_id])
    return ("decode", tuple(sorted(step.decode)))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_steps_are_the_policys(make_scheduler, make_request, name):
    """For the same arrivals, vLLM's scheduler takes the policy's steps (tests/test_policy.py
    states what they are), every request finishes, and no step mixes prefill and decode."""
    num_kv_blocks, arrivals = SCENARIOS[name]
    scheduler = make_scheduler(num_blocks=num_kv_blocks)
    steps: list[Step] = []
    for arrival in sorted(arrivals, key=lambda a: a.step):
        while len(steps) < arrival.step:
            steps.append(run_step(scheduler))
        request = make_request(arrival.req_id, arrival.num_prompt_tokens, arrival.max_tokens)
        scheduler.add_request(request)
    steps += run_all(scheduler)

    assert_never_mixed(steps)
    assert [trace_of(s) for s in steps] == simulate(arrivals, num_kv_blocks)
    for i, step in enumerate(steps):
        if step.decode:
            assert set(step.decode) == step.running, f"step {i} leaves a running request out"
    finished = [req_id for s in steps for req_id in s.finished]
    assert sorted(finished) == sorted(a.req_id for a in arrivals)
    assert not any(s.output.preempted_req_ids for s in steps)


def test_admission_holds_request_while_blocks_are_free(make_scheduler, make_request):
    """Holdback is by worst case: C waits in `waiting` though the pool has room for its prompt."""
    scheduler = make_scheduler(num_blocks=21)
    scheduler.add_request(make_request("A", 20, max_tokens=100))
    scheduler.add_request(make_request("B", 20, max_tokens=140))
    run_step(scheduler)
    run_step(scheduler)
    scheduler.add_request(make_request("C", 20, max_tokens=140))

    for _ in range(5):
        step = run_step(scheduler)
        assert "C" not in step.scheduled
    request_c = scheduler.requests["C"]
    assert request_c.status is RequestStatus.WAITING
    assert request_c in list(scheduler.waiting)
    assert request_c not in scheduler.running
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > 2  # C's prompt fits


def test_finished_request_frees_blocks(make_scheduler, make_request):
    """Reaching max_tokens returns every block and tells the worker the id on the next step."""
    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    scheduler.add_request(make_request("A", 40, max_tokens=5))

    step = run_step(scheduler)
    assert pool.get_num_free_blocks() == free_before - 3  # 40 tokens: 3 blocks
    steps = [step, *run_all(scheduler)]

    assert steps[-1].finished == ["A"]
    assert pool.get_num_free_blocks() == free_before
    assert "A" not in scheduler.requests
    assert "A" in run_step(scheduler).output.finished_req_ids


def test_aborted_request_frees_blocks(make_scheduler, make_request):
    """An abort, running or held, frees its blocks and reaches the worker; others go on."""
    scheduler = make_scheduler(num_blocks=21)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    scheduler.add_request(make_request("A", 40, max_tokens=100))
    scheduler.add_request(make_request("B", 20, max_tokens=20))  # 3 blocks
    scheduler.add_request(make_request("C", 20, max_tokens=140))  # held: 9 + 3 + 10 > 20
    run_step(scheduler)
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.requests["C"] in list(scheduler.waiting)

    scheduler.finish_requests("C", RequestStatus.FINISHED_ABORTED)  # aborted while held
    assert "C" not in scheduler.requests and not list(scheduler.waiting)
    free_with_a = pool.get_num_free_blocks()
    scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # aborted while decoding
    assert pool.get_num_free_blocks() == free_with_a + 3  # A's 41 computed tokens: 3 blocks
    assert "A" not in scheduler.requests

    steps = run_all(scheduler)
    assert {"A", "C"} <= steps[0].output.finished_req_ids
    assert all("A" not in s.scheduled and "C" not in s.scheduled for s in steps)
    assert steps[-1].finished == ["B"]
    assert pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize("first_done", [True, False], ids=["finished", "running"])
def test_prefix_cache_hit(make_scheduler, make_request, first_done):
    """A prompt sharing a block-aligned prefix with an earlier one starts past the cached part."""
    scheduler = make_scheduler()
    shared = [1000 + i for i in range(3 * BLOCK_SIZE + 5)]  # 3 full blocks and a partial one
    scheduler.add_request(make_request("A", [*shared, 1, 2, 3], max_tokens=20))
    run_step(scheduler)
    if first_done:
        scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("B", [*shared, 4, 5, 6, 7], max_tokens=2))

    step = run_step(scheduler)

    assert [new.req_id for new in step.output.scheduled_new_reqs] == ["B"]
    new_b = step.output.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens == 3 * BLOCK_SIZE
    assert step.output.num_scheduled_tokens["B"] == len(shared) + 4 - 3 * BLOCK_SIZE
    assert step.prefill == ["B"]


class _AcceptAll(StructuredOutputGrammar):
    """A compiled grammar that allows every token."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def reset(self):
        pass


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "failed"])
def test_grammar_compilation_does_not_block_others(make_scheduler, make_request, compiled):
    """A request waiting for its grammar lets later ones run; it starts (or fails) when ready."""
    scheduler = make_scheduler()
    grammar_request = make_request(
        "G", 12, max_tokens=3, structured=StructuredOutputsParams(regex="[0-9]+")
    )
    assert grammar_request.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    pending: Future = Future()
    grammar_request.structured_output_request.grammar = pending  # as grammar_init leaves it
    scheduler.add_request(grammar_request)
    scheduler.add_request(make_request("A", 12, max_tokens=10))

    steps = [run_step(scheduler) for _ in range(3)]
    assert steps[0].prefill == ["A"] and steps[1].decode == ["A"] and steps[2].decode == ["A"]
    assert grammar_request in list(scheduler.waiting)

    if compiled:
        pending.set_result(_AcceptAll())
    else:
        pending.set_exception(RuntimeError("grammar does not compile"))
    steps = run_all(scheduler)

    if compiled:
        assert steps[0].prefill == ["G"]
        assert set(steps[1].decode) == {"A", "G"}
        assert grammar_request.get_finished_reason() is not None
    else:
        assert "G" in steps[0].finished
        assert grammar_request.status is RequestStatus.FINISHED_ERROR
        assert all("G" not in s.scheduled for s in steps)
    assert "A" in [req_id for s in steps for req_id in s.finished]
    assert_never_mixed(steps)


def test_a_pooling_prompt_is_known_by_the_request_it_came_in():
    # vLLM's front end: `<request id>-<i>`; the engine appends `-<8 hex>`.
    assert batch_of("embd-3f2a9c-0-1a2b3c4d") == "embd-3f2a9c"
    assert batch_of("embd-3f2a9c-17-1a2b3c4d") == "embd-3f2a9c"
    assert batch_of("0-1a2b3c4d") is None  # LLM.embed's counter
    assert batch_of("cmpl-abc-1a2b3c4d") is None


def test_a_step_waits_while_a_requests_prompts_arrive_and_no_longer():
    gathering = Gathering(max_seconds=0.02)
    assert gathering.hold(["a"] * 2, now=0.0)  # a first look at two: more may follow
    assert gathering.hold(["a"] * 5, now=0.001)  # still arriving
    assert not gathering.hold(["a"] * 5, now=0.002)  # none came since the last look: go
    # A lone first prompt goes at once (a request of one prompt never waits); if more of its
    # request arrive meanwhile, they are gathered.
    assert not gathering.hold([None, "b"], now=1.0)
    assert gathering.hold(["b"] * 3, now=1.005)
    assert not gathering.hold(["b"] * 3, now=1.006)
    # Prompts arriving for longer than max_seconds: the step goes with what is there.
    assert gathering.hold(["c"] * 2, now=2.0)
    assert gathering.hold(["c"] * 3, now=2.019)
    assert not gathering.hold(["c"] * 4, now=2.021)
    # A request's prompts taken by a step are forgotten with it; one still arriving holds.
    assert not gathering.hold(["c"], now=2.03)
    assert gathering.hold(["c", "d", "d"], now=2.031)
    assert not gathering.hold([], now=2.04) and gathering.seen == {}
    assert not gathering.hold([None, None], now=3.0)  # ids of another form never wait
