"""Serving compiled programs from the compile cache: a fresh machine filled from the remote store
compiles nothing (logs and /metrics say so), and --require-cached refuses a configuration that is
not cached, naming the ones that are."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from tests.helpers import metrics_after_one_completion, run_vllm_aot
from vllm_aot.testing import free_port, running_server, vllm_server_command

# With SHAPE_ARGS: one bucket of each kind, four programs.
BUCKETS = {"decode_batch_buckets": [4], "prefill_token_buckets": [64]}


def vllm_aot(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_vllm_aot(*args, env=env, timeout=900)


@pytest.fixture(scope="module")
def shared_store(tiny_model_dirs, tmp_path_factory):
    """A remote directory store holding the tiny model's compiled configuration."""
    store = f"file://{tmp_path_factory.mktemp('shared-store')}"
    filled = vllm_aot(
        "export",
        str(tiny_model_dirs("llama")),
        "--compile-only",
        "--max-model-len",
        "256",
        "--batch-size",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--dtype",
        "float32",
        "--decode-batch-buckets",
        "4",
        "--prefill-token-buckets",
        "64",
    )
    assert filled.returncode == 0, filled.stderr[-3000:]
    pushed = vllm_aot("cache", "sync", "--direction", "push", "--remote", store)
    assert pushed.returncode == 0 and "pushed 5 programs" in pushed.stdout, pushed.stderr[-3000:]
    return store


def test_a_fresh_cache_filled_from_the_remote_store_compiles_nothing(
    tiny_model_dir, shared_store, tmp_path
):
    port = free_port()
    options = {
        "backend": "inductor",
        "remote_cache": shared_store,
        "require_cached": True,
        **BUCKETS,
    }
    command = vllm_server_command(tiny_model_dir, port, args=SHAPE_ARGS, additional_config=options)
    env = {**SERVER_ENV, "VLLM_AOT_COMPILE_CACHE": str(tmp_path / "empty-local-cache")}
    log = tmp_path / "server.log"
    with running_server(command, port=port, env=env, log_path=log, timeout=300) as url:
        metrics = metrics_after_one_completion(url)
    text = log.read_text()
    assert text.count("fetched from the remote store in") == 5
    assert " compiled in " not in text
    assert 'vllm_aot:cache_hits_total{tier="remote"} 5.0' in metrics
    assert "vllm_aot:cache_misses_total 0.0" in metrics
    assert "vllm_aot:compile_seconds_total 0.0" in metrics


def test_require_cached_refuses_an_uncached_configuration_naming_the_cached_ones(
    tiny_model_dir, shared_store, tmp_path
):
    options = {
        "backend": "inductor",
        "remote_cache": shared_store,
        "require_cached": True,
        **BUCKETS,
        "decode_batch_buckets": [2, 4],
    }
    command = vllm_server_command(
        tiny_model_dir, free_port(), args=SHAPE_ARGS, additional_config=options
    )
    env = {
        **os.environ,
        **SERVER_ENV,
        "VLLM_AOT_COMPILE_CACHE": str(tmp_path / "empty-local-cache"),
    }
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "decode_b2_c256" in output and "--require-cached" in output
    assert "4 | 256 | 16 | 64 | float32" in output  # the cached configuration, from the registry
    assert "compiling" not in output.lower().replace("compiling is not allowed", "")
