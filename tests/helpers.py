"""Small helpers shared by tests."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import torch

from vllm_aot.models.layers import PagedKV, quantize_kv
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


def attention_inputs(g, tokens, shape, pool_shape, dtype, pool_dtype, scales):
    """Random inputs of an attention kernel: (q [tokens, heads, dim], k_new, v_new [tokens,
    kv_heads, dim] in `dtype`, the layer's `PagedKV`: pools of (blocks, block size) in
    `pool_dtype`, stored with the (K, V) `scales`), drawn from generator `g` in that order."""
    heads, kv_heads, dim = shape
    q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    k_new, v_new = (torch.randn(tokens, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_scale, v_scale = (torch.tensor(s) for s in scales)
    k_pool, v_pool = (
        quantize_kv(torch.randn(*pool_shape, kv_heads, dim, generator=g), s, pool_dtype)
        for s in (k_scale, v_scale)
    )
    return q, k_new, v_new, PagedKV(k_pool, v_pool, k_scale, v_scale)


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
