"""Requests that could crash an engine, sent to real servers: each fails alone (HTTP 400 or
500 for it), a stream in flight beside it gets every token, and the next request is served.

With the engine never crashing, a poison request cannot take down a `vllm-aot serve` replica
either (the proxy never retries a request it has sent).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from vllm_aot.testing import free_port, running_server, vllm_server_command

VOCAB_SIZE = 49152  # the tiny model's
PROMPT_IDS = [1, 504, 2365, 6354, 16438]  # any in-vocabulary ids


@pytest.fixture(scope="module")
def lenient_server(tiny_model_dirs, tmp_path_factory):
    """A server that lets through what a lenient front end passes to the engine: no logprobs
    limit (-1) and no tokenizer, so token ids go unchecked."""
    port = free_port()
    args = ["--served-model-name", "tiny", *SHAPE_ARGS]
    args += ["--max-logprobs", "-1", "--skip-tokenizer-init"]
    command = vllm_server_command(
        tiny_model_dirs("llama"), port, args=args, additional_config={"backend": "eager"}
    )
    log = tmp_path_factory.mktemp("lenient") / "server.log"
    with running_server(command, port=port, env=SERVER_ENV, log_path=log, timeout=240) as url:
        yield url


def completion(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 8, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def assert_served(url: str, max_tokens: int = 8) -> None:
    response = completion(url, max_tokens=max_tokens, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens


def test_logprobs_beyond_the_head_get_400_naming_the_limit(lenient_server):
    """--max-logprobs -1 is capped at the 20 the head programs compute."""
    for too_many in (21, 50):
        response = completion(lenient_server, logprobs=too_many)
        assert response.status_code == 400, response.text
        assert "max allowed: 20" in response.text
    assert_served(lenient_server)


def test_a_prompt_outside_the_vocabulary_fails_alone_while_a_stream_flows(lenient_server):
    body = {
        "model": "tiny",
        "prompt": PROMPT_IDS,
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{lenient_server}/v1/completions", json=body) as stream,
    ):
        lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
        next(lines)  # the stream's request is running
        poison = completion(lenient_server, prompt=[5, VOCAB_SIZE + 10, 7])
        assert poison.status_code == 500, poison.text
        for line in lines:
            usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == 60
    assert_served(lenient_server)


def test_requests_over_the_compiled_limits_get_400_and_the_engine_serves_on(client):
    refused = [
        ({"logprobs": 21}, "max allowed: 20"),
        ({"extra_body": {"prompt_logprobs": 21}}, "max allowed: 20"),
        (
            {"extra_body": {"logprob_token_ids": [1], "logprobs": 1}},
            "does not return logprob_token",
        ),
    ]
    for params, message in refused:
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4, **params)
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 6
