"""Start-up refusals a user sees before any request: a KV budget too small, unsupported options."""

from __future__ import annotations

import os
import subprocess

import pytest

from vllm_aot.testing import free_port, vllm_server_command


def start_and_fail(model_dir, args, env, timeout=240) -> str:
    command = vllm_server_command(
        model_dir, free_port(), args=args, additional_config={"backend": "eager"}
    )
    proc = subprocess.run(
        command,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode != 0, "the server should have refused to start"
    return proc.stdout + proc.stderr


@pytest.mark.slow  # compiles programs before vLLM sizes the KV cache
def test_kv_budget_below_one_max_length_sequence_is_refused(tiny_model_dir):
    # 64 KiB of KV cannot hold one 256-token sequence of the tiny model (8 KiB per 16-token block).
    log = start_and_fail(
        tiny_model_dir,
        ["--max-model-len", "256", "--kv-cache-memory-bytes", str(16 * 1024), "--dtype", "float32"],
        env={},
    )
    assert "max seq len (256)" in log or "max_model_len" in log


def test_unsupported_options_are_refused_with_what_is_supported(tiny_model_dir):
    log = start_and_fail(
        tiny_model_dir,
        ["--max-model-len", "256", "--dtype", "float16"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert "dtype float16 is not supported by vllm-aot; supported: bfloat16, float32" in log
