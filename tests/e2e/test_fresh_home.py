"""A fresh machine whose only vllm-aot state is the remote store: `vllm-aot serve` of the bundled
model fetches its programs, the kernels library, the prepared model (and vLLM's model records,
when the filling machine had them), and compiles, builds and converts nothing. Prints the seconds
from launch to the first /health 200."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import metrics_after_one_completion, run_vllm_aot
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.testing import built_here, free_port, fresh_home_env, running_server

# One bucket of each kind (four programs) of the bundled model in bfloat16.
SHAPES = ["--batch-size", "4", "--max-model-len", "256"]
BUCKETS = ["--max-num-batched-tokens", "64", "--decode-batch-buckets", "4"]
BUCKETS += ["--prefill-token-buckets", "64"]


def vllm_aot(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_vllm_aot(*args, env=env, timeout=1800)


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory) -> str:
    """A store filled by a machine that has everything: the configuration's programs (compiled or
    from this session's cache), its registry record, the kernels library and the prepared model."""
    store = f"file://{tmp_path_factory.mktemp('store')}"
    filled = vllm_aot("export", "--compile-only", *SHAPES, *BUCKETS, "--dtype", "bfloat16")
    assert filled.returncode == 0, filled.stderr[-3000:]
    pushed = vllm_aot("cache", "sync", "--direction", "push", "--remote", store)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    artefacts = Path(store.removeprefix("file://")) / "artefacts"
    assert {p.name for p in artefacts.iterdir()} >= {"kernels", "models"}, pushed.stdout
    return store


@pytest.mark.slow
def test_a_fresh_home_serves_from_the_remote_store_building_nothing(filled_store, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--port", str(port), *SHAPES]
    env = {**fresh_home_env(home, filled_store), "VLLM_LOGGING_LEVEL": "INFO"}
    log = tmp_path / "serve.log"
    started = time.monotonic()
    with running_server(command, port=port, env=env, log_path=log, timeout=600) as url:
        seconds = time.monotonic() - started
        metrics = metrics_after_one_completion(url)
    print(f"\nfresh home -> first /health 200 in {seconds:.1f} s")
    text = log.read_text(errors="replace")
    assert f"{DEFAULT_MODEL_NAME}: fetched from {filled_store}" in text
    assert f"{DEFAULT_MODEL_NAME}: converted" not in text
    assert built_here(home) == []
    assert list((home / ".cache" / "vllm-aot" / "kernels").glob("*/library.json"))
    assert " compiled in " not in text
    assert 'vllm_aot:cache_hits_total{tier="remote"} 4.0' in metrics
    assert "vllm_aot:cache_misses_total 0.0" in metrics
