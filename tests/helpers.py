"""Small helpers shared by tests."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

from vllm_aot.runtime.config import RuntimeConfig


def run_vllm_aot(
    *args: str, env: dict | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`vllm-aot ARGS` in a child process, its output captured (text)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_aot.cli.main", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_config(**overrides) -> RuntimeConfig:
    """A small eager configuration: 4 rows, 256 tokens, blocks of 16, 64-token prefill chunks."""
    fields = dict(
        max_num_seqs=4,
        max_model_len=256,
        block_size=16,
        max_num_batched_tokens=64,
        dtype="float32",
        backend="eager",
    )
    fields.update(overrides)
    return RuntimeConfig(**fields)


def tiny_arch(**overrides):
    """The architecture of `make_tiny_model`'s Llama, without building the model."""
    from vllm_aot.models.config import ModelArch, RopeSpec

    fields = dict(
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=49152,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-5,
        rope=RopeSpec(theta=10000.0, head_dim=16),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return ModelArch(**fields)


# Four programs (one of each kind) for the cache tests with a fake compiler.
TINY_CACHE_CONFIG = RuntimeConfig(
    max_num_seqs=2,
    max_model_len=256,
    max_num_batched_tokens=64,
    dtype="float32",
    decode_batch_buckets=(2,),
    prefill_token_buckets=(64,),
)


def metrics_after_one_completion(url: str) -> str:
    """A started server's /metrics text, then one short completion that must succeed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=b'{"prompt": "Hello", "max_tokens": 4, "temperature": 0}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    return metrics
