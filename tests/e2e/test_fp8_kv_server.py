"""`vllm serve --kv-cache-dtype fp8` on our platform: vLLM sizes the pool in fp8 pages (four times
the float32 blocks for the same bytes) and the server answers from fp8 pools."""

from __future__ import annotations

import re

import openai
import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from vllm_aot.testing import free_port, running_server, vllm_server_command

KV_BYTES = 1 << 30  # SERVER_ENV's VLLM_CPU_KVCACHE_SPACE
# The tiny model's float32 block: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
FLOAT32_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.mark.slow  # a server of its own: ~90 s
def test_fp8_kv_server_gets_four_times_the_blocks_and_answers(tiny_model_dir, tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    args = [*SHAPE_ARGS, "--kv-cache-dtype", "fp8"]
    command = vllm_server_command(
        tiny_model_dir, port, args=args, additional_config={"backend": "eager"}
    )
    with running_server(command, port=port, env=SERVER_ENV, log_path=log, timeout=240) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(
            model=str(tiny_model_dir), prompt="The quick brown fox", max_tokens=8, temperature=0
        )
        assert out.usage.completion_tokens == 8
    pool = re.search(r"KV pool of (\d+) blocks of (\S+)", log.read_text())
    assert pool is not None, "the worker logs its pool"
    assert pool.group(2) == "torch.float8_e4m3fn"
    assert int(pool.group(1)) == 4 * (KV_BYTES // FLOAT32_BLOCK_BYTES)
