"""`vllm.LLM` (offline inference) on our platform, eager backend, on a tiny random model.

The engine runs in a subprocess (tests/e2e/offline_llm.py) so vLLM's process-global state
(platform, distributed groups, compilation config) cannot leak into other tests. Its greedy
tokens must be exactly those of our runtime's own Generator with the same config.
"""

from __future__ import annotations

import pytest

from tests.e2e.offline_llm import run_offline_llm
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator

# The same shapes as tiny_config(): 4 rows, 256 tokens, blocks of 16, 64-token prefill chunks.
ENGINE_KWARGS = {
    "additional_config": {"backend": "eager"},
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "block_size": 16,
    "dtype": "float32",
}
# More prompts than rows (requests wait, join and leave), and prompts longer than a 64-token
# prefill chunk (chunked prefill reading earlier blocks).
PROMPT_LENGTHS = (5, 40, 90, 17, 3, 70)
MAX_TOKENS = 12
CHAT_MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Hello there, who are you?"}]
TIMEOUT_S = 240


def _prompts() -> list[list[int]]:
    return [[(97 * i + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def offline_results(tiny_model_dirs, tmp_path_factory) -> dict:
    """The subprocess's JSON result (its log is attached to the failure when it breaks)."""
    spec = {
        "model": str(tiny_model_dirs("llama")),
        "engine": ENGINE_KWARGS,
        "prompt_token_ids": _prompts(),
        "max_tokens": MAX_TOKENS,
        "messages": MESSAGES,
        "chat_max_tokens": CHAT_MAX_TOKENS,
    }
    log = tmp_path_factory.mktemp("offline") / "llm.log"
    return run_offline_llm(spec, log, TIMEOUT_S)


def test_llm_runs_on_our_platform(offline_results):
    assert offline_results["platform"] == "AotPlatform"


def test_generate_returns_the_requested_number_of_tokens(offline_results):
    outputs = offline_results["generate"]
    assert [o["prompt_token_ids"] for o in outputs] == _prompts()
    for length, out in zip(PROMPT_LENGTHS, outputs, strict=True):
        assert len(out["token_ids"]) == MAX_TOKENS, f"prompt of {length} tokens: {out}"
        assert out["finish_reason"] == "length"
        assert out["text"]


def test_generate_equals_our_generator(offline_results, tiny_model_dirs):
    model, _ = load_model(tiny_model_dirs("llama"), tiny_config(), show_progress=False)
    requests = [GenerationRequest(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in _prompts()]
    expected = [r.token_ids for r in Generator(model).generate(requests)]
    got = [o["token_ids"] for o in offline_results["generate"]]
    for length, ours, theirs in zip(PROMPT_LENGTHS, expected, got, strict=True):
        assert theirs == ours, f"prompt of {length} tokens: vllm.LLM {theirs} != Generator {ours}"


def test_chat_returns_text(offline_results):
    chat = offline_results["chat"]
    assert chat["text"].strip(), f"empty chat reply: {chat}"
    assert 0 < len(chat["token_ids"]) <= CHAT_MAX_TOKENS
    assert len(chat["prompt_token_ids"]) > 5  # the chat template wrapped the message
