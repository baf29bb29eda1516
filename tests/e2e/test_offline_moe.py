"""`vllm.LLM` on our platform serving the tiny MoE models (Qwen3-MoE, Mixtral), eager backend:
vLLM's engine takes their architectures, and its greedy tokens are our runtime's (which equal
HF's: tests/test_moe.py)."""

from __future__ import annotations

import pytest

from tests.e2e.offline_llm import run_offline_llm
from tests.e2e.test_offline import ENGINE_KWARGS, MESSAGES, _prompts
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator

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
