"""A real `vllm serve` process on a tiny random model, our platform, eager backend."""

from __future__ import annotations

import json

import pytest

from vllm_aot.testing import free_port, running_server, vllm_server_command

MAX_MODEL_LEN = 256
# The tiny model's shapes (4 rows, 256 tokens, 64-token chunks, blocks of 16, float32).
SHAPE_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--block-size",
    "16",
    "--dtype",
    "float32",
]
SERVER_ARGS = [
    "--served-model-name",
    "tiny",
    *SHAPE_ARGS,
    "--enable-prompt-embeds",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    # A random-weight model would fill JSON with whitespace until max_tokens.
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
]
# Fork the engine process as `vllm-aot serve` does (plain vLLM spawns it: ~12 s more per start).
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_AOT_ENGINE_FORK": "1",
    "GOMP_SPINCOUNT": "10000",  # as vllm-aot serve sets it (serve/launch.py)
    "VLLM_AOT_FRONT_END_NICE": "idle",  # likewise
}


@pytest.fixture(scope="session")
def profiler_dir(tmp_path_factory):
    """Where `tiny_server` writes torch profiler traces (/start_profile, /stop_profile)."""
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def tiny_server_log(tmp_path_factory):
    """`tiny_server`'s output: the front end's and the engine's log lines."""
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dirs, tiny_server_log, profiler_dir):
    """Base URL of a running server; stopped (SIGTERM, then SIGKILL) after the session.

    The torch profiler is configured but idle until a test POSTs /start_profile.
    """
    port = free_port()
    profiler = {"profiler": "torch", "torch_profiler_dir": str(profiler_dir)}
    command = vllm_server_command(
        tiny_model_dirs("llama"),
        port,
        args=[*SERVER_ARGS, "--profiler-config", json.dumps(profiler)],
        additional_config={"backend": "eager"},
    )
    with running_server(
        command, port=port, env=SERVER_ENV, log_path=tiny_server_log, timeout=240
    ) as url:
        yield url


@pytest.fixture
def client(tiny_server):
    import openai

    return openai.OpenAI(base_url=f"{tiny_server}/v1", api_key="unused", max_retries=0)
