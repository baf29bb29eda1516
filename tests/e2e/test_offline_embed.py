"""`vllm.LLM(...).embed` on our platform (in a process of its own, as test_offline.py runs it):
the bundled all-MiniLM-L6-v2 against sentence-transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.offline_llm import RESULT_PREFIX

SCRIPT = Path(__file__).with_name("offline_llm.py")
ENV = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "TOKENIZERS_PARALLELISM": "false"}
# More sentences than a 64-token bucket holds, of 3 to ~40 tokens.
SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun for hours.",
    "Paris is the capital of France.",
    "What is the capital of France?",
    "x",
    "Static shapes are declared once and padded once; buckets are chosen once and carried.",
] * 3
LENGTHS = (5, 200, 40, 90, 17, 130)  # tokens of the decoder's prompts


def llm_embed(model_dir, engine: dict, prompts: list, log_dir) -> np.ndarray:
    """`LLM(model_dir, **engine).embed(prompts)` in a subprocess."""
    spec = {"model": str(model_dir), "engine": engine, "sentences": prompts}
    with open(log_dir / "llm.log", "wb") as stderr:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), json.dumps(spec)],
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=stderr,
            timeout=240,
            check=False,
        )
    lines = [x for x in proc.stdout.decode().splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail((log_dir / "llm.log").read_text(errors="replace")[-6000:])
    return np.array(json.loads(lines[0].removeprefix(RESULT_PREFIX))["embeddings"])


@pytest.mark.slow  # the embeddings server test covers the encoder in the fast suite
def test_llm_embed_matches_sentence_transformers(embedding_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    engine = {
        "runner": "pooling",
        "dtype": "float32",
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "additional_config": {"backend": "eager"},
    }
    ours = llm_embed(embedding_model_dir, engine, SENTENCES, tmp_path)
    reference = SentenceTransformer(str(embedding_model_dir), device="cpu").encode(SENTENCES)
    cosines = (ours * reference).sum(-1) / np.linalg.norm(reference, axis=-1)
    assert cosines.min() >= 0.9999


# Slow, both: once in three clean-clone runs the LLM process ended after printing its result
# with "terminate called without an active exception" (a C++ thread left joinable at exit),
# not yet explained; the maths and the runner are covered fast (test_decoder_embed.py,
# test_pooling_runner.py).
@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_llm_embed_of_a_converted_decoder_matches_hf(tiny_model_dir, tmp_path, pooling):
    """--convert embed: LAST-pooled prompts in 64-token chunks (vLLM chunks them), MEAN-pooled
    ones whole, several a step; against HF's last hidden states."""
    import torch
    from transformers import AutoModel

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in LENGTHS]
    engine = {
        "runner": "pooling",
        "convert": "embed",
        "pooler_config": {"seq_pooling_type": pooling},
        "dtype": "float32",
        "max_num_seqs": 4,
        "block_size": 16,
        "max_model_len": 256,
        "max_num_batched_tokens": 64 if pooling == "LAST" else 256,
        "additional_config": {"backend": "eager"},
    }
    ours = llm_embed(tiny_model_dir, engine, prompts, tmp_path)
    hf = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([p])).last_hidden_state[0].double() for p in prompts]
    pooled = torch.stack([s[-1] if pooling == "LAST" else s.mean(0) for s in states]).numpy()
    reference = pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)
    assert ours.shape == reference.shape
    assert (ours * reference).sum(-1).min() >= 0.9999
