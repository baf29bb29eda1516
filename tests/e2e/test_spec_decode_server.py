"""Speculative decoding served: `--speculative-config` with n-gram drafts, a self-speculative
draft (the target's first layers) and a draft model with a pool of its own, against the same
server without it. Greedy text must be byte-identical at 1 and 8 streams; drafts must have been
accepted (vLLM's spec-decode series on /metrics); bad configurations are refused at start."""

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


def _server(model_dir, spec: dict | None, log_path, extra=(), additional=None):
    args = [*SHAPES, *extra]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    port = free_port()
    command = vllm_server_command(
        model_dir, port, args=args, additional_config={"backend": "eager", **(additional or {})}
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


def _check_identical(
    model_dir, prompts, max_tokens, tmp_path, *, check_sampling=False, spec=NGRAM, additional=None
):
    with _server(model_dir, None, tmp_path / "plain.log") as url:
        expected = {s: _texts(url, prompts, max_tokens, s) for s in (1, 8)}
    with _server(model_dir, spec, tmp_path / "spec.log", additional=additional) as url:
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
@pytest.mark.parametrize("method", ["ngram", "self", "multi-step"])
def test_greedy_text_is_byte_identical_on_smollm2(default_model_dir, tmp_path, method):
    """The end-to-end chat prompts and the copy-heavy set, SmolLM2 in float32: n-gram drafts,
    the first 24 of its 30 layers drafting for it (fewer agree with the whole too rarely for a
    draft to be accepted before the gate stops them: docs/benchmarks.md), and all 30
    (multi-step decoding: requests ending at their EOS mid-step)."""
    from vllm_aot.accuracy.prompts import CHAT_PROMPTS

    prompts = [*CHAT_PROMPTS, *COPY_PROMPTS]
    if method == "ngram":
        _check_identical(default_model_dir, prompts, 64, tmp_path)
        return
    spec = _self_draft(default_model_dir)
    if method == "multi-step":
        with _server(default_model_dir, None, tmp_path / "plain.log") as url:
            expected = {s: _texts(url, prompts, 64, s) for s in (1, 8)}
        additional = {"draft_layers": "all"}
        with _server(default_model_dir, spec, tmp_path / "ms.log", additional=additional) as url:
            assert {s: _texts(url, prompts, 64, s) for s in (1, 8)} == expected
        return
    additional = {"draft_layers": 24}
    _check_identical(default_model_dir, prompts, 64, tmp_path, spec=spec, additional=additional)


def _self_draft(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}


def test_self_speculative_greedy_text_is_byte_identical(tiny_model_dirs, tmp_path):
    """The target's first layer of two drafts for it (its KV pool shared): the text is the
    plain server's, drafts are verified, and the draft passes show on /metrics."""
    model_dir = tiny_model_dirs("llama")
    counters = _check_identical(
        model_dir,
        COPY_PROMPTS,
        32,
        tmp_path,
        spec=_self_draft(model_dir),
        additional={"draft_layers": 1},
    )
    assert counters["vllm:spec_decode_num_draft_tokens_total"] > 0, counters


def _request(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({"model": "m", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_multi_step_decoding_gives_the_plain_servers_text_and_samples(tiny_model_dirs, tmp_path):
    """The whole model drafting for itself (`draft_layers: "all"`): greedy text byte-identical
    at 1 and 8 streams, seeded samples identical to the plain server's (its drafts are its own
    tokens), a stop string landing where it does without drafts, every draft accepted (but
    those drafted past a request's end of sequence) and no verify program run."""
    model_dir = tiny_model_dirs("llama")
    sampled = {"prompt": COPY_PROMPTS[0], "max_tokens": 40, "temperature": 1.0, "seed": 7}
    sampled["ignore_eos"] = True

    def observe(url: str) -> dict:
        texts = {s: _texts(url, COPY_PROMPTS, 32, s) for s in (1, 8)}
        sample = _request(url, sampled)
        stop = sample["choices"][0]["text"][12:16]
        stopped = _request(url, {**sampled, "stop": [stop]})["choices"][0]
        return {"texts": texts, "sample": sample["choices"][0]["text"], "stopped": stopped}

    with _server(model_dir, None, tmp_path / "plain.log") as url:
        expected = observe(url)
    additional = {"draft_layers": "all"}
    spec = _self_draft(model_dir)
    with _server(model_dir, spec, tmp_path / "ms.log", additional=additional) as url:
        assert observe(url) == expected
        _wait_counters(url, "vllm:spec_decode_num_accepted_tokens_total", 1)
        # Our program counters reach /metrics through the engine's stats file, after vLLM's.
        counters = _wait_counters(url, "decode", 1)
    assert expected["stopped"]["finish_reason"] == "stop"
    drafted = counters["vllm:spec_decode_num_draft_tokens_total"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafted > 100 and accepted >= 0.98 * drafted, counters  # all but past an EOS
    assert counters.get("verify", 0) == 0 and counters["decode"] > 0, counters


@pytest.mark.slow  # the self-speculative server test covers the fast suite
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
    ("spec", "additional", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_max": 3}, {}, "1..8"),
        pytest.param(  # each refusal starts a server: one in the fast suite
            "self", {"draft_layers": 5}, "draft_layers 5 (supported: 1..2", marks=pytest.mark.slow
        ),
        pytest.param(
            None,
            {"draft_layers": 1},
            "draft_layers needs --speculative-config method draft_model",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_unsupported_speculative_configs_are_refused_at_start(
    tiny_model_dirs, spec, additional, message
):
    model_dir = tiny_model_dirs("llama")
    spec = _self_draft(model_dir) if spec == "self" else spec
    args = [*SHAPES] if spec is None else [*SHAPES, "--speculative-config", json.dumps(spec)]
    command = vllm_server_command(
        model_dir,
        free_port(),
        args=args,
        additional_config={"backend": "eager", **additional},
    )
    env = {**os.environ, **SERVER_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
