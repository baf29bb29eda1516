"""vLLM's engine controls on our worker, through one real server under VLLM_SERVER_DEV_MODE=1:
`/pause`, sleep mode, `/release_kv_cache_memory`, `/reset_encoder_cache`, `/collective_rpc`,
`--max-model-len -1` (vLLM's auto-fit), `/reset_prefix_cache` with requests in flight,
`/v1/responses` and beam search. Each control is followed by a request the server completes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import httpx
import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from vllm_aot.testing import free_port, running_server, vllm_server_command

# Auto-fit: the tiny model allows 4,096 tokens (512 bytes of KV each, float32); 1 MiB of KV
# holds 127 usable blocks of 16, so vLLM lowers max_model_len to 2,032.
KV_BYTES = 1024 * 1024
FITTED_LEN = (KV_BYTES // (16 * 512) - 1) * 16
ARGS = [
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "-1",
    "--kv-cache-memory-bytes",
    str(KV_BYTES),
    *SHAPE_ARGS[2:],  # the tiny model's shapes but its length: vLLM fits that to the KV budget
]
# Without VLLM_CPU_KVCACHE_SPACE, which would replace --kv-cache-memory-bytes (vLLM's CPU platform).
ENV = {k: v for k, v in SERVER_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
ENV["VLLM_SERVER_DEV_MODE"] = "1"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("controls") / "server.log"


@pytest.fixture(scope="module")
def url(tiny_model_dirs, server_log):
    port = free_port()
    command = vllm_server_command(
        tiny_model_dirs("llama"), port, args=ARGS, additional_config={"backend": "eager"}
    )
    with running_server(command, port=port, env=ENV, log_path=server_log, timeout=300) as url:
        yield url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def post(http, path: str, **params) -> dict:
    response = http.post(path, params=params)
    assert response.status_code == 200, f"{path}: {response.status_code} {response.text}"
    return response.json() if response.content else {}


def completes(http, max_tokens: int = 4) -> None:
    """A completion of `max_tokens` tokens: the engine serves."""
    response = http.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The quick brown fox",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens


def test_auto_fit_lowers_max_model_len_to_the_kv_budget(http, server_log):
    (model,) = http.get("/v1/models").json()["data"]
    assert model["max_model_len"] == FITTED_LEN
    assert f"max_model_len {FITTED_LEN}, fitted to the KV budget" in server_log.read_text()
    completes(http)


def test_pause_clears_caches_and_resume_serves(http):
    assert post(http, "/pause") == {"status": "paused"}  # clear_cache=true: vLLM's default
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert post(http, "/resume") == {"status": "resumed"}
    completes(http)


def test_sleep_and_wake_up(http):
    assert post(http, "/sleep", level=1) == {"status": "sleeping", "level": 1}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert post(http, "/wake_up")["status"] == "awake"
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    completes(http)


def test_release_kv_cache_memory_after_a_pause(http):
    post(http, "/pause")
    assert post(http, "/release_kv_cache_memory") == {"status": "kv_cache_released"}
    assert post(http, "/wake_up", tags="kv_cache")["status"] == "awake"
    assert http.get("/is_paused").json() == {"is_paused": False}
    completes(http)


def test_reset_encoder_cache_and_collective_rpc(http):
    post(http, "/reset_encoder_cache")
    for method in ("execute_dummy_batch", "reset_encoder_cache", "wake_up"):
        response = http.post("/collective_rpc", json={"method": method})
        assert response.status_code == 200, f"{method}: {response.text}"
    completes(http)


def test_a_method_the_worker_does_not_serve_is_an_error_not_a_crash(http, url):
    """tests/test_worker_methods.py NOT_SERVED: the call fails (vLLM answers 500 and may drop
    the connection after it), the engine serves on."""
    with httpx.Client(base_url=url, timeout=60) as client:
        try:
            response = client.post("/collective_rpc", json={"method": "compute_weight_checksums"})
            assert response.status_code == 500
        except httpx.ReadError:
            pass
    completes(http)


def test_reset_prefix_cache_with_requests_in_flight(http, url):
    """Four streams running when the reset preempts them: each recomputes and completes."""
    num_streams, max_tokens = 4, 200
    started = Barrier(num_streams + 1)

    def stream() -> int:
        body = {
            "model": "tiny",
            "prompt": "The quick brown fox",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        tokens, is_started = 0, False
        with (
            httpx.Client(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not is_started:
                    is_started = True
                    started.wait(timeout=60)
        return tokens

    with ThreadPoolExecutor(num_streams) as pool:
        streams = [pool.submit(stream) for _ in range(num_streams)]
        started.wait(timeout=60)
        assert not any(s.done() for s in streams), "the streams ended before the reset"
        assert post(http, "/reset_prefix_cache", reset_running_requests="true") == {"success": True}
        assert [s.result(timeout=120) for s in streams] == [max_tokens] * num_streams
    completes(http)


def test_responses_api(http):
    response = http.post(
        "/v1/responses",
        json={"model": "tiny", "input": "Say hello", "max_output_tokens": 8, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] in ("completed", "incomplete"), body
    assert body["usage"]["output_tokens"] > 0
    completes(http)


def test_beam_search(http):
    response = http.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The quick brown fox",
            "max_tokens": 6,
            "n": 3,
            "use_beam_search": True,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 3
    assert len({c["text"] for c in choices}) == 3  # three different beams
    completes(http)
