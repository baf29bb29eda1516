"""Speculative decoding served: `--speculative-config` with n-gram drafts and a draft model with
a pool of its own, against the same server without it. Greedy text must be byte-identical at 1
and 8 streams; drafts must have been accepted (vLLM's spec-decode series on /metrics); bad
configurations are refused at start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import SERVER_ENV
from vllm_aot.testing import free_port, running_server, vllm_server_command

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SHAPES = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "128",
    "--block-size",
    "16",
    "--dtype",
    "float32",
    "--served-model-name",
    "m",
]
# Copying and editing a given text: the continuation repeats the prompt, where n-grams match.
_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great "
    "lamp, wound the clockwork that turned the lens, and wrote the weather in his logbook."
)
COPY_PROMPTS = [
    f"Repeat this text exactly: {_TEXT}\nText: {_TEXT[:60]}",
    f"Fix the spelling: {_TEXT.replace('the', 'teh')}\nFixed: The lighthouse keeper",
    f"Summarise: {_TEXT} {_TEXT}\nSummary: The lighthouse keeper climbed",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    f"Quote: {_TEXT}\nQuote again: {_TEXT[:30]}",
    "red green blue red green blue red green blue red green",
    f"{_TEXT}\n{_TEXT}\n{_TEXT[:40]}",
]


def _server(model_dir, spec: dict | None, log_path, extra=()):
    args = [*SHAPES, *extra]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    port = free_port()
    command = vllm_server_command(
        model_dir, port, args=args, additional_config={"backend": "eager"}
    )
    return running_server(command, port=port, env=SERVER_ENV, log_path=log_path, timeout=300)


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["text"]


def _texts(url: str, prompts, max_tokens: int, streams: int) -> list[str]:
    with ThreadPoolExecutor(streams) as pool:
        return list(pool.map(lambda p: _complete(url, p, max_tokens), prompts))


def _spec_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_num_"):
                counters[sample.name] = counters.get(sample.name, 0) + sample.value
            if sample.name == "vllm_aot:program_executions_total":
                kind = sample.labels["kind"]
                counters[kind] = counters.get(kind, 0) + sample.value
    return counters


def _wait_counters(url: str, key: str, minimum: float) -> dict[str, float]:
    deadline = time.monotonic() + 15
    counters = _spec_counters(url)
    while counters.get(key, 0) < minimum and time.monotonic() < deadline:
        time.sleep(0.5)
        counters = _spec_counters(url)
    return counters


def _check_identical(model_dir, prompts, max_tokens, tmp_path, *, check_sampling=False, spec=NGRAM):
    with _server(model_dir, None, tmp_path / "plain.log") as url:
        expected = {s: _texts(url, prompts, max_tokens, s) for s in (1, 8)}
    with _server(model_dir, spec, tmp_path / "spec.log") as url:
        for streams in (1, 8):
            assert _texts(url, prompts, max_tokens, streams) == expected[streams], streams
        if check_sampling:
            _check_seeded_sampling(url, prompts[-1])
        counters = _wait_counters(url, "verify", 1)
    assert counters["vllm:spec_decode_num_drafts_total"] > 0, counters
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0, counters
    assert counters["verify"] > 0 and counters["verify_greedy"] > 0, counters
    return counters


def _check_seeded_sampling(url: str, prompt: str) -> None:
    """Temperature 1 through the sampling verify head: full length, and a seed reproduces it."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 1.0, "seed": 7}
    body["ignore_eos"] = True
    texts = []
    for _ in range(2):
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            out = json.loads(response.read())
        assert out["usage"]["completion_tokens"] == 32
        texts.append(out["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.slow
def test_ngram_greedy_text_is_byte_identical_on_the_tiny_model(tiny_model_dirs, tmp_path):
    _check_identical(tiny_model_dirs("llama"), COPY_PROMPTS, 48, tmp_path, check_sampling=True)


@pytest.mark.slow
def test_greedy_text_is_byte_identical_on_smollm2(default_model_dir, tmp_path):
    """The end-to-end chat prompts and the copy-heavy set, SmolLM2 in float32."""
    from vllm_aot.accuracy.prompts import CHAT_PROMPTS

    _check_identical(default_model_dir, [*CHAT_PROMPTS, *COPY_PROMPTS], 64, tmp_path)


def test_a_draft_model_of_its_own_is_accepted_throughout(tiny_model_dirs, tmp_path):
    """A copy of the target as a separate draft model (its own programs, weights and pool,
    catching up on each prompt and on what verify steps accept): the text is the plain
    server's and, the draft being the target, nearly every draft is accepted."""
    model_dir = tiny_model_dirs("llama")
    draft_dir = tmp_path / "draft"
    shutil.copytree(model_dir, draft_dir)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    counters = _check_identical(model_dir, COPY_PROMPTS, 32, tmp_path, spec=spec)
    drafted = counters["vllm:spec_decode_num_draft_tokens_total"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 100 and accepted >= 0.95 * drafted, counters


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_max": 3}, "1..8"),
        pytest.param(  # each refusal starts a server: one in the fast suite
            "self", "a draft model that is the served model itself", marks=pytest.mark.slow
        ),
    ],
)
def test_unsupported_speculative_configs_are_refused_at_start(tiny_model_dirs, spec, message):
    model_dir = tiny_model_dirs("llama")
    if spec == "self":  # the served model drafting for itself
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    args = [*SHAPES, "--speculative-config", json.dumps(spec)]
    command = vllm_server_command(
        model_dir, free_port(), args=args, additional_config={"backend": "eager"}
    )
    env = {**os.environ, **SERVER_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
