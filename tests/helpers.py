"""Small helpers shared by tests: the kernels' skip marker, waits on conditions, processes
found without tripping over the machine's other ones, tiny configurations."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest
import torch

from vllm_aot.kernels import kernels_enabled
from vllm_aot.models.layers import PagedKV, quantize_kv
from vllm_aot.runtime.config import RuntimeConfig

T = TypeVar("T")

# Tests of our C++ kernels: they build (and run) on x86-64 with AVX2 and FMA only.
needs_kernels = pytest.mark.skipif(
    not kernels_enabled(), reason="kernels not built here: they need x86-64 with AVX2 and FMA"
)


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate()` until it returns something true, and return that; fail naming `what`
    after `timeout` s. Deadlines here are generous: they catch a hang, not a slow machine."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(interval)
    return value


# What reading another process may raise: it exited, it is a zombie, it is not ours to read.
PROCESS_UNREADABLE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def cmdline_of(process: psutil.Process) -> list[str]:
    """`process`'s arguments; [] where it exited, is a zombie or may not be read."""
    try:
        return process.cmdline()
    except PROCESS_UNREADABLE:
        return []


def children_of(pid: int, recursive: bool = True) -> list[psutil.Process]:
    """The processes under `pid` (all generations unless `recursive` is False); [] once it is
    gone."""
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except PROCESS_UNREADABLE:
        return []


def processes_matching(predicate: Callable[[list[str]], bool]) -> list[psutil.Process]:
    """Every process of the machine whose arguments satisfy `predicate`, by pid; processes that
    exit, are zombies or may not be read while we look are skipped."""
    return [p for p in psutil.process_iter() if predicate(cmdline_of(p))]


def server_on_port(port: int) -> psutil.Process:
    """The process started with `port` among its arguments (a server's); of a tree of such
    processes (a server and the engine it forked), its root."""
    found = processes_matching(lambda argv: str(port) in argv)
    pids = {p.pid for p in found}
    for process in found:
        try:
            if process.ppid() not in pids:
                return process
        except PROCESS_UNREADABLE:
            continue
    raise AssertionError(f"no process has {port} among its arguments")


def is_gone(process: psutil.Process | int) -> bool:
    """Whether `process` (or the process of that pid) exited; a zombie counts, as it runs
    nothing."""
    try:
        process = psutil.Process(process) if isinstance(process, int) else process
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
