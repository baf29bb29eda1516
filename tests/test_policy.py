"""The scheduling policy on hand-built requests (no vLLM), and the generate loop following it.

`tests/test_scheduler.py` checks that vLLM's scheduler under AotScheduler takes the same steps
for the same arrivals (`tests/policy_trace.py`), so the two drivers cannot drift apart.
"""

from __future__ import annotations

import pytest

from tests.helpers import tiny_config
from tests.policy_trace import (
    CHUNK,
    SCENARIOS,
    View,
    limits,
    shapes,
    simulate,
    simulate_scenario,
)
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime import policy
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.policy import StepKind

LIMITS = limits(num_kv_blocks=21)  # 20 usable blocks of 16 tokens


def view(req_id="R", prompt=10, max_tokens=4, computed=0, outputs=0) -> View:
    return View(req_id, prompt, max_tokens, computed, outputs)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("prompt", "outputs", "computed", "expected"),
    [
        (65, 0, 0, True),  # nothing computed yet
        (65, 0, 64, True),  # one prompt token left after a 64-token chunk: still a prefill
        (65, 1, 65, False),  # the prompt done, its sampled token next: a decode
        (65, 5, 69, False),
        (65, 5, 66, True),  # several known tokens not computed (a resumed request)
    ],
)
def test_is_prefilling(prompt, outputs, computed, expected):
    assert policy.is_prefilling(view(prompt=prompt, computed=computed, outputs=outputs)) is expected


@pytest.mark.unit
def test_chunks_cut_a_long_prompt_at_max_num_batched_tokens():
    request = view(prompt=150)
    chunks = []
    while policy.is_prefilling(request):
        chunks.append(policy.next_chunk(request, LIMITS))
        request.num_computed_tokens = chunks[-1].stop
    assert chunks == [range(0, 64), range(64, 128), range(128, 150)]
    assert CHUNK == 64


@pytest.mark.unit
def test_worst_case_blocks_is_prompt_plus_max_tokens_capped_at_max_model_len():
    assert policy.worst_case_blocks(view(prompt=20, max_tokens=100), LIMITS) == 8  # 120 tokens
    assert policy.worst_case_blocks(view(prompt=16, max_tokens=16), LIMITS) == 2
    assert policy.worst_case_blocks(view(prompt=200, max_tokens=500), LIMITS) == 16  # 256 tokens


@pytest.mark.unit
def test_admission_counts_rows_and_every_worst_case():
    running = [view("A", 20, 100), view("B", 20, 140)]  # 8 + 10 of 20 blocks
    assert policy.can_admit(view("C", 20, 12), running, LIMITS)  # 2 more: exactly 20
    assert not policy.can_admit(view("C", 20, 13), running, LIMITS)  # 3 more: 21
    four = [view(str(i), 1, 1) for i in range(4)]
    assert not policy.can_admit(view("E", 1, 1), four, LIMITS)  # max_num_seqs rows run


@pytest.mark.unit
def test_a_prompt_in_flight_runs_alone_before_releases_and_decodes():
    decoding, prompt = view("D", computed=10, outputs=1), view("P", prompt=150, computed=64)
    step = policy.schedule([decoding, prompt], [view("W")], LIMITS)
    assert (step.kind, step.requests) == (StepKind.PREFILL, (prompt,))


@pytest.mark.unit
def test_the_oldest_waiting_request_is_released_alone_or_all_running_decode():
    running = [view("A", 20, 100, computed=20, outputs=1)]
    big, small = view("B", 20, 220), view("C", 10, 2)  # B's 15 blocks do not fit beside A's 8
    step = policy.schedule(running, [small, big], LIMITS)
    assert (step.kind, step.requests) == (StepKind.RELEASE, (small,))
    # The oldest waiting request holds the later ones back though they would fit.
    step = policy.schedule(running, [big, small], LIMITS)
    assert (step.kind, step.requests) == (StepKind.DECODE, tuple(running))
    assert policy.schedule([], [], LIMITS).requests == ()


@pytest.mark.unit
def test_waiting_requests_start_in_arrival_order_one_per_step():
    trace = simulate_scenario("fifo")
    assert trace[:4] == [
        ("prefill", "A", 10),
        ("prefill", "B", 10),
        ("prefill", "C", 10),
        ("decode", ("A", "B", "C")),
    ]


@pytest.mark.unit
def test_one_prompt_at_a_time_chunk_by_chunk():
    trace = simulate_scenario("chunked")
    assert trace[:7] == [
        ("prefill", "A", 64),
        ("prefill", "A", 64),
        ("prefill", "A", 22),
        ("prefill", "B", 64),
        ("prefill", "B", 64),
        ("prefill", "B", 22),
        ("decode", ("A", "B")),
    ]


@pytest.mark.unit
def test_the_last_prompt_token_runs_alone_as_a_prefill():
    trace = simulate_scenario("late_prompt")
    assert trace[:4] == [
        ("prefill", "D", 10),
        ("prefill", "P", 64),
        ("prefill", "P", 1),
        ("decode", ("D", "P")),
    ]


@pytest.mark.unit
def test_a_request_waits_until_its_worst_case_fits():
    trace = simulate_scenario("worst_case")
    last_a = max(i for i, s in enumerate(trace) if s[0] == "decode" and "A" in s[1])
    c_start = trace.index(("prefill", "C", 20))
    assert c_start == last_a + 1
    # Meanwhile A and B decode on their own, though C's prompt alone would fit the free blocks.
    assert set(trace[2:c_start]) == {("decode", ("A", "B"))}


@pytest.mark.unit
def test_at_most_max_num_seqs_rows_run():
    trace = simulate_scenario("max_num_seqs")
    assert max(len(s[1]) for s in trace if s[0] == "decode") == 4
    r0_last = max(i for i, s in enumerate(trace) if s[0] == "decode" and "r0" in s[1])
    assert trace[r0_last + 1] == ("prefill", "r4", 10)


class _Recording:
    """A CompiledModel that records the shape of each step it runs."""

    def __init__(self, model) -> None:
        self._model = model
        self.shapes: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def prefill(self, chunks, sampling):
        self.shapes.append(("prefill", sum(len(c.token_ids) for c in chunks)))
        return self._model.prefill(chunks, sampling)

    def decode(self, rows, sampling):
        self.shapes.append(("decode", len(rows)))
        return self._model.decode(rows, sampling)


ARRIVING_TOGETHER = [
    n for n, (_, arrivals) in SCENARIOS.items() if not any(a.step for a in arrivals)
]


@pytest.mark.parametrize("name", ARRIVING_TOGETHER)
def test_the_generate_loop_takes_the_policys_steps(tiny_model_dir, name):
    num_kv_blocks, arrivals = SCENARIOS[name]
    config = tiny_config(num_kv_blocks=num_kv_blocks)
    model, _ = load_model(tiny_model_dir, config, show_progress=False)
    recording = _Recording(model)
    prompts = [[100 + i] * a.num_prompt_tokens for i, a in enumerate(arrivals)]
    requests = [
        GenerationRequest(p, a.max_tokens, ignore_eos=True)
        for p, a in zip(prompts, arrivals, strict=True)
    ]
    Generator(recording).generate(requests)
    assert recording.shapes == shapes(simulate(arrivals, num_kv_blocks))
