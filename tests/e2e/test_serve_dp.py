"""`vllm-aot serve --data-parallel-size 2`: real replicas behind the proxy, killed and stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import children_of, is_gone, wait_until
from vllm_aot.testing import free_port, stop_process, wait_healthy

API_KEY = "secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SHAPES = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "64", "--dtype", "float32"]  # fmt: skip
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores"
)


def serve_command(model_dir, port, *args):
    return [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(model_dir),
            "--backend", "eager", "--port", str(port), *SHAPES, *args]  # fmt: skip


@pytest.fixture(scope="module")
def dp_server(tiny_model_dirs, tmp_path_factory):
    """(base URL, the `vllm-aot serve` process, its log path) with two replicas."""
    logs = tmp_path_factory.mktemp("serve-dp")
    port = free_port()
    command = serve_command(
        tiny_model_dirs("llama"), port, "--data-parallel-size", "2", "--api-key", API_KEY,
        "--proxy-health-interval", "0.5", "--replica-log-dir", str(logs),
    )  # fmt: skip
    log = open(logs / "serve.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        command, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=300)
        yield url, process, logs / "serve.log"
    finally:
        stop_process(process)
        log.close()


def stream_completion(url: str, max_tokens: int, events: list, started: threading.Event | None):
    """Stream one completion; append (replica, [SSE payloads]) to `events`."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    payloads: list[str] = []
    replica = None
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120
        ) as response:
            replica = response.headers.get("x-vllm-aot-replica")
            if response.status_code != 200:  # an answer, not a stream: e.g. 503 shutting down
                payloads.append(f"HTTP {response.status_code}: {response.read().decode()}")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line.removeprefix("data: "))
                    if started is not None:
                        started.set()
    except httpx.HTTPError as exc:
        payloads.append(f"transport error: {exc!r}")
    events.append((replica, payloads))


def completion_tokens(payloads: list[str]) -> int:
    """Tokens the stream delivered, from its usage chunk (vLLM may merge tokens into one event
    when the client lags, so events are not tokens)."""
    usage = [json.loads(p)["usage"] for p in payloads if p.startswith("{") and '"usage"' in p]
    return next(u["completion_tokens"] for u in reversed(usage) if u)


def wait_health(url: str, condition, what: str, timeout: float = 240) -> httpx.Response:
    """Poll the proxy's /health until `condition(its replicas)` holds; the last answer."""
    answers: list[httpx.Response] = []

    def holds() -> bool:
        answers.append(httpx.get(f"{url}/health", timeout=30))
        return condition(answers[-1].json()["replicas"])

    wait_until(holds, timeout, what, interval=0.2)
    return answers[-1]


def wait_all_healthy(url: str) -> None:
    wait_health(url, lambda replicas: all(r["healthy"] for r in replicas), "all healthy")


def run_streams(url: str, num_streams: int, max_tokens: int, during=None, first_of=None):
    """Stream `num_streams` completions; once the first `first_of` (default: all) have a first
    token, call `during()`."""
    events: list = []
    started = [threading.Event() for _ in range(num_streams)]
    threads = [
        threading.Thread(target=stream_completion, args=(url, max_tokens, events, started[i]))
        for i in range(num_streams)
    ]
    for thread in threads:
        thread.start()
    if during is not None:
        num_started = lambda: sum(e.is_set() for e in started) >= (first_of or num_streams)
        wait_until(num_started, 120, "first tokens of the streams")
        during()
    for thread in threads:
        thread.join(180)
    return events


def replica_served(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30)
    assert response.status_code == 200
    return response.headers["x-vllm-aot-replica"]


def replica_pid(log: Path, index: int) -> int:
    """Replica `index`'s process, from serve's log (its /health names no address)."""
    return int(re.findall(rf"replica {index} \(pid (\d+)\)", log.read_text())[-1])


def test_replicas_are_closed_to_anyone_but_the_proxy(dp_server):
    url, _, log = dp_server
    wait_all_healthy(url)
    text = log.read_text()
    assert API_KEY not in text  # the printed command line masks it
    for index in (0, 1):
        replica = psutil.Process(replica_pid(log, index))
        assert API_KEY not in " ".join(replica.cmdline())  # nothing for `ps` to show
        port = re.findall(rf"replica {index} \(pid \d+\) on .*:(\d+)$", text, re.M)[-1]
        for path in ("/health", "/v1/models", "/tokenize", "/metrics"):
            response = httpx.get(f"http://127.0.0.1:{port}{path}", headers=AUTH, timeout=30)
            assert response.status_code == 401, path  # even with a client's key
    assert "127.0.0.1" not in httpx.get(f"{url}/health", timeout=30).text
    assert httpx.options(f"{url}/metrics", timeout=30).status_code == 401


def test_api_key_is_checked_through_the_proxy(dp_server):
    url, _, _ = dp_server
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    response = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30)
    assert [m["id"] for m in response.json()["data"]] == ["tiny"]
    # vLLM itself leaves /tokenize (and /invocations, /pooling, ...) open; the proxy does not.
    body = {"model": "tiny", "prompt": "Once upon a time"}
    response = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
    response = httpx.post(f"{url}/tokenize", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["count"] > 0
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def test_two_replicas_serve_concurrent_streams(dp_server):
    url, _, _ = dp_server
    events = run_streams(url, num_streams=6, max_tokens=16)
    assert len(events) == 6
    for _, payloads in events:
        assert payloads[-1] == "[DONE]"
        assert completion_tokens(payloads) == 16
    assert {replica for replica, _ in events} == {"0", "1"}


def test_metrics_have_both_replicas_series(dp_server):
    url, _, _ = dp_server
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401  # no --expose-metrics
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    for replica in ("0", "1"):
        assert f'vllm:num_requests_running{{replica="{replica}"' in text
        assert f'vllm_aot_proxy_requests_total{{replica="{replica}"}}' in text
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1


def test_killed_replica_is_ejected_its_streams_fail_cleanly_and_it_comes_back(dp_server):
    url, process, log = dp_server
    wait_all_healthy(url)
    victim = psutil.Process(replica_pid(log, 0))

    events = run_streams(url, num_streams=4, max_tokens=230, during=lambda: victim.kill())
    by_replica = {"0": [], "1": []}
    for replica, payloads in events:
        by_replica[replica].append(payloads)
    assert len(by_replica["0"]) == len(by_replica["1"]) == 2  # least-loaded: two each
    for payloads in by_replica["0"]:  # cut short, told so in-band, no hang
        assert "error" in json.loads(payloads[-1])
        assert "replica 0 failed" in payloads[-1]
    for payloads in by_replica["1"]:
        assert payloads[-1] == "[DONE]"
        assert completion_tokens(payloads) == 230

    # The streams fail as the connection drops; the manager notices the exit on its next tick.
    health = wait_health(url, lambda replicas: not replicas[0]["healthy"], "replica 0 ejected")
    assert health.status_code == 200  # one replica is enough
    assert {replica_served(url) for _ in range(4)} == {"1"}

    # The manager restarts it (backoff 1 s) and the health checks re-admit it.
    def readmitted() -> bool:
        assert process.poll() is None
        return httpx.get(f"{url}/health", timeout=30).json()["replicas"][0]["healthy"]

    wait_until(readmitted, 240, "replica 0 re-admitted", interval=1)
    assert {replica_served(url) for _ in range(4)} == {"0", "1"}
    metrics = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    assert 'vllm_aot_proxy_ejections_total{replica="0"} 1' in metrics
    assert "replica 0 process exited with code -9; restarting in 1 s" in log.read_text()


def test_sigterm_with_16_streams_in_flight_stops_every_process_within_the_grace(dp_server):
    url, process, log = dp_server
    wait_all_healthy(url)  # not in the middle of an earlier test's restart
    children = children_of(process.pid)
    assert len(children) >= 4  # two API servers and their engines

    def sigterm() -> None:
        children.extend(p for p in children_of(process.pid) if p not in children)
        process.send_signal(signal.SIGTERM)

    # 8 running (4 per replica), 8 waiting in vLLM's queues; each would take far past the grace.
    events = run_streams(url, num_streams=16, max_tokens=230, during=sigterm, first_of=8)
    assert process.wait(60) == 0
    assert len(events) == 16  # every client got an answer or an end, none hangs
    for _, payloads in events:
        assert payloads, "a stream ended without a word"
    assert [p.pid for p in children if not is_gone(p)] == []
    assert "all replicas stopped" in log.read_text()


def test_a_replica_failing_at_start_up_stops_everything(tiny_model_dir):
    # vLLM's parser takes this flag (as serve's own check of the flags does); the platform
    # refuses it in every replica's engine at start-up.
    connector = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
    command = serve_command(
        tiny_model_dir, free_port(), "--data-parallel-size", "2", "--kv-transfer-config", connector
    )
    process = subprocess.Popen(
        command, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        stop_process(process)
    text = output.decode(errors="replace")
    assert process.returncode == 1
    assert "during start-up" in text and "all replicas stopped" in text
    for line in text.splitlines():
        if "(pid " in line and "replica" in line:
            pid = int(line.split("(pid ")[1].split(")")[0])
            assert is_gone(pid)
