"""Async scheduling (vLLM's default, the shared `tiny_server`) against `--no-async-scheduling`:
the same answers, streamed together, and a stop string lands at the same character."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import SERVER_ARGS, SERVER_ENV
from vllm_aot.accuracy.prompts import CHAT_PROMPTS
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
