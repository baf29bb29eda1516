"""Async scheduling (vLLM's default, the shared `tiny_server`) against `--no-async-scheduling`:
the same answers, streamed together, and a stop string lands at the same character; the front
end's threads run below the step's (plugin/front_end.py)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest

from tests.e2e.conftest import SERVER_ARGS, SERVER_ENV, SHAPE_ARGS
from tests.helpers import PROCESS_UNREADABLE, children_of, processes_matching, wait_until
from vllm_aot.accuracy.prompts import CHAT_PROMPTS
from vllm_aot.placement import split_front_end
from vllm_aot.plugin.front_end import IDLE
from vllm_aot.testing import free_port, running_server, vllm_server_command


@pytest.fixture(scope="module")
def sync_client(tiny_model_dirs, tmp_path_factory):
    port = free_port()
    command = vllm_server_command(
        tiny_model_dirs("llama"),
        port,
        args=[*SERVER_ARGS, "--no-async-scheduling"],
        additional_config={"backend": "eager"},
    )
    log = tmp_path_factory.mktemp("sync_server") / "server.log"
    with running_server(command, port=port, env=SERVER_ENV, log_path=log, timeout=240) as url:
        assert ", synchronous scheduling" in log.read_text()
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def answers(client: openai.OpenAI) -> list[tuple[str, str]]:
    """Every chat prompt at once (so they decode together), greedy: (text, finish reason)."""

    def ask(prompt: str) -> tuple[str, str]:
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        return out.choices[0].message.content, out.choices[0].finish_reason

    with ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        return list(pool.map(ask, CHAT_PROMPTS))


def test_async_and_sync_scheduling_give_the_same_greedy_answers(
    client, sync_client, tiny_server_log
):
    assert ", async scheduling" in tiny_server_log.read_text()
    assert answers(client) == answers(sync_client)


def test_a_stop_string_lands_exactly_under_async_scheduling(client, sync_client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    text = sync_client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    for server in (client, sync_client):
        out = server.completions.create(stop=[stop], **kwargs).choices[0]
        assert (out.text, out.finish_reason) == (text[: text.index(stop)], "stop")


def server_processes(port: int) -> tuple[int, int]:
    """The API server listening on `port` (`vllm_aot.plugin.vllm_serve`) and its engine."""
    servers = processes_matching(
        lambda argv: "vllm_aot.plugin.vllm_serve" in argv and str(port) in argv
    )
    assert servers, f"no API server process on port {port}"

    def is_engine(process: psutil.Process) -> bool:
        try:
            return process.name().startswith("VLLM::")
        except PROCESS_UNREADABLE:
            return False

    engines = [p for p in children_of(servers[0].pid, recursive=False) if is_engine(p)]
    return servers[0].pid, engines[0].pid


def thread_nice(pid: int) -> dict[int, int]:
    """Each thread's nice value, 20 for nice 19 at SCHED_IDLE (`front_end.IDLE`)."""
    levels = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        is_idle = os.sched_getscheduler(tid) == os.SCHED_IDLE
        levels[tid] = os.getpriority(os.PRIO_PROCESS, tid) + is_idle
    return levels


def thread_cores(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_front_end_runs_below_the_step_threads_and_on_its_own_core(tiny_model_dirs, tmp_path):
    """As `vllm-aot serve` starts a server: its API server, then the engine's own threads, at
    SCHED_IDLE; the step thread and its OpenMP team at nice 0. With a core reserved for the
    front end (`VLLM_CPU_NUM_OF_RESERVED_CPU=1`), the API server and the engine's own threads
    run on the last core (with its hyperthread siblings), the step thread on the others, and
    requests are answered."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a core for the front end needs two")
    port = free_port()
    command = vllm_server_command(
        tiny_model_dirs("llama"),
        port,
        args=["--served-model-name", "tiny", *SHAPE_ARGS],
        additional_config={"backend": "eager"},
    )
    command[1:3] = ["-m", "vllm_aot.plugin.vllm_serve"]  # what vllm-aot serve runs
    env = {**SERVER_ENV, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    with running_server(command, port=port, env=env, log_path=tmp_path / "log") as url:
        api_server, engine = server_processes(port)
        # It lowers itself once the engine has forked.
        is_idle = lambda: set(thread_nice(api_server).values()) == {IDLE}
        wait_until(is_idle, 60, "the API server's threads at SCHED_IDLE", interval=0.2)
        engine_threads = thread_nice(engine)
        assert engine_threads[engine] == IDLE  # the engine's main thread: scheduling, outputs
        assert 0 in engine_threads.values()  # the step thread (and its OpenMP team)

        compute, front_end = map(set, split_front_end(cores, env, is_lowered=True))
        on_front_end = lambda: all(c == front_end for c in thread_cores(api_server).values())
        wait_until(on_front_end, 60, f"the API server's threads on cores {front_end}", interval=0.2)
        engine_cores = thread_cores(engine)
        assert engine_cores[engine] == front_end
        steps = [tid for tid, nice in engine_threads.items() if nice == 0]
        assert steps and all(engine_cores[tid] == compute for tid in steps)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
