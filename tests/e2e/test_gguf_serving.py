"""`vllm-aot serve PATH.gguf`: the tiny model's file served by its path, its tokenizer and chat
template read from the file, or from --tokenizer DIR."""

from __future__ import annotations

import sys

import openai
import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from tests.gguf_files import write_gguf
from vllm_aot.testing import free_port, running_server


@pytest.mark.parametrize(
    "tokenizer",
    [None, pytest.param("given", marks=pytest.mark.slow)],  # a server each: ~1.5 min here
)
def test_a_gguf_file_serves_completions_and_chats(tiny_model_dirs, tmp_path, tokenizer):
    hf_dir = tiny_model_dirs("llama")
    path = write_gguf(hf_dir, tmp_path / "download", family="llama") / "model.gguf"
    for name in path.parent.iterdir():  # a file downloaded alone
        if name != path:
            name.unlink()
    port, log = free_port(), tmp_path / "serve.log"
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(path)]
    command += ["--backend", "eager", "--port", str(port), *SHAPE_ARGS]
    command += ["--tokenizer", str(hf_dir)] if tokenizer else []
    env = {**SERVER_ENV, "VLLM_AOT_MODELS_DIR": str(tmp_path / "models")}
    with running_server(command, port=port, env=env, log_path=log, timeout=300) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = [m.id for m in client.models.list().data]
        assert model == str(path)
        out = client.completions.create(
            model=model, prompt="The quick brown fox", max_tokens=8, temperature=0
        )
        assert out.usage.completion_tokens == 8
        messages = [{"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            temperature=0,
        )
        assert chat.usage.completion_tokens == 4
        assert chat.usage.prompt_tokens == len(chat_prompt(hf_dir, messages))


def chat_prompt(hf_dir, messages) -> list[int]:
    """The ids of SmolLM2's chat template (a system prompt of its own, then the turns)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
