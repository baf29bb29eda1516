"""vLLM serving the tiny MoE models (Qwen3-MoE, Mixtral) on our platform, eager backend:
`vllm.LLM` on one rank and `vllm-aot serve --tensor-parallel-size 2 --enable-expert-parallel`;
their greedy tokens are our runtime's on one rank (which equal HF's: tests/test_moe.py)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import SERVER_ENV
from tests.e2e.offline_llm import run_offline_llm
from tests.e2e.test_offline import ENGINE_KWARGS, MESSAGES, _prompts
from tests.e2e.test_tensor_parallel_server import one_rank_tokens, served_tokens, tp_command
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.testing import free_port, running_server

MAX_TOKENS = 8


@pytest.mark.slow  # an engine start per family, 1-1.5 min each on this machine
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_llm_generates_our_runtimes_tokens(tiny_model_dirs, tmp_path, family):
    model_dir = tiny_model_dirs(family)
    spec = {
        "model": str(model_dir),
        "engine": ENGINE_KWARGS,
        "prompt_token_ids": _prompts(),
        "max_tokens": MAX_TOKENS,
        "messages": MESSAGES,
        "chat_max_tokens": MAX_TOKENS,
    }
    results = run_offline_llm(spec, tmp_path / "llm.log", timeout=300)
    assert results["platform"] == "AotPlatform"
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    requests = [GenerationRequest(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in _prompts()]
    expected = [r.token_ids for r in Generator(model).generate(requests)]
    assert [o["token_ids"] for o in results["generate"]] == expected
    assert results["chat"]["text"].strip()


@pytest.mark.slow  # a server of two ranks: ~1.5 min here
def test_expert_parallel_server_answers_what_one_rank_computes(tiny_model_dirs, tmp_path):
    """Each of vLLM's two workers holds 4 of the 8 experts (and half the heads)."""
    model_dir = tiny_model_dirs("qwen3_moe")
    port = free_port()
    command = tp_command(model_dir, port, 2, ["--enable-expert-parallel"])
    log = tmp_path / "server.log"
    with running_server(command, port=port, env=SERVER_ENV, log_path=log, timeout=300) as url:
        assert served_tokens(url) == one_rank_tokens(model_dir)
    lines = log.read_text(errors="replace")
    assert "rank 0 holds experts 0-3 of 8 (expert parallel)" in lines
    assert "rank 1 holds experts 4-7 of 8 (expert parallel)" in lines
