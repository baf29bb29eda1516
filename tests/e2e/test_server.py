"""`vllm serve` on our platform, driven by the openai client like a user would."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import MAX_MODEL_LEN

PROMPT = "The quick brown fox"


def test_completion_returns_the_requested_number_of_tokens(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    parts = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    # How many chunks carry the text depends on how far the client lags the engine (vLLM
    # coalesces what it has not sent yet): on a loaded machine all of it may come in one.
    assert parts and "".join(parts) == whole


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.prompt_tokens > 5  # the chat template wrapped the message


def test_seeded_sampling_is_reproducible(client):
    def run(seed):
        return (
            client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert run(1234) == run(1234)
    assert len({run(s) for s in range(4)}) > 1


def test_logprobs_are_consistent_with_the_tokens(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) >= 3
        # Greedy: the chosen token is the most likely one, with the logprob reported for it.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)
        assert top[token] == pytest.approx(logprob, abs=1e-4)
        assert logprob <= 0


def test_n_greater_than_one_returns_n_choices(client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    first_id = _first_greedy_token_id(client)
    stopped = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [first_id]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1


def test_logit_bias_and_penalties_change_the_output(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    biased = client.completions.create(logit_bias={"1000": 100}, **kwargs)
    assert biased.choices[0].text == _detok(client, [1000] * 8)
    plain = client.completions.create(**kwargs).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain), "the random model repeats itself when greedy"
    penalised = (
        client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kwargs)
        .choices[0]
        .logprobs.tokens
    )
    assert len(set(penalised)) > len(set(plain))


def test_min_tokens_holds_back_the_stop_token(client):
    first_id = _first_greedy_token_id(client)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [first_id], "min_tokens": 4},
    )
    assert out.usage.completion_tokens >= 4


def test_json_schema_output_parses_and_validates(client):
    schema = {
        "type": "object",
        # Bounded, so a random-weight model cannot ramble past max_tokens inside a value.
        "properties": {
            "name": {"type": "string", "enum": ["Ann", "Bob"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_regex_and_choice_outputs(client):
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert out.choices[0].text in ("yes", "no")


def test_named_tool_call_returns_valid_arguments(client):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,  # arguments constrained to the schema, not only the call envelope
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,  # the hermes envelope costs many tokens
        temperature=0,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_too_long_prompt_gets_400_naming_the_limit_while_others_flow(client):
    results = {}

    def normal():
        results["ok"] = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=20, temperature=0
        )

    worker = threading.Thread(target=normal)
    worker.start()
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt="word " * 400, max_tokens=5)
    worker.join(60)
    assert excinfo.value.status_code == 400
    assert str(MAX_MODEL_LEN) in str(excinfo.value)
    assert results["ok"].usage.completion_tokens > 0


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    lines = [line for line in text.splitlines() if line.startswith(name)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_client_disconnect_frees_the_slot(client, tiny_server):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{tiny_server}/v1/completions", json=body) as response,
    ):
        for i, _ in enumerate(response.iter_lines()):
            if i > 3:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while _metric(tiny_server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the abandoned request still holds its slot"
        time.sleep(0.2)
    # The full batch (4 rows) is available again: four requests run at once.
    threads = [
        threading.Thread(
            target=client.completions.create,
            kwargs=dict(
                model="tiny", prompt=PROMPT, max_tokens=60, extra_body={"ignore_eos": True}
            ),
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    peak = 0.0
    while any(t.is_alive() for t in threads):
        peak = max(peak, _metric(tiny_server, "vllm:num_requests_running"))
        time.sleep(0.05)
    assert peak == 4


def _first_greedy_token_id(client) -> int:
    first = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0
    )
    return _token_id(client, first.choices[0].logprobs.tokens[0])


def _token_id(client, token: str) -> int:
    out = client.post(
        "/../tokenize",
        body={"model": "tiny", "prompt": token, "add_special_tokens": False},
        cast_to=httpx.Response,
    )
    return out.json()["tokens"][0]


def _detok(client, ids: list[int]) -> str:
    out = client.post(
        "/../detokenize", body={"model": "tiny", "tokens": ids}, cast_to=httpx.Response
    )
    return out.json()["prompt"]


def test_prefix_cache_hit_gives_the_same_answer(client, tiny_server):
    """A repeated long prompt reuses cached blocks (a later prefill segment) and must not change
    the output."""
    prompt = " ".join(f"word{i}" for i in range(60))
    before = _metric(tiny_server, "vllm:prefix_cache_hits_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert _metric(tiny_server, "vllm:prefix_cache_hits_total") > before
    assert first.choices[0].text == second.choices[0].text
