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


def test_llm_embed_matches_sentence_transformers(embedding_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    engine = {
        "runner": "pooling",
        "dtype": "float32",
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "additional_config": {"backend": "eager"},
    }
    spec = {"model": str(embedding_model_dir), "engine": engine, "sentences": SENTENCES}
    with open(tmp_path / "llm.log", "wb") as stderr:
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
        pytest.fail((tmp_path / "llm.log").read_text(errors="replace")[-6000:])
    ours = np.array(json.loads(lines[0].removeprefix(RESULT_PREFIX))["embeddings"])
    reference = SentenceTransformer(str(embedding_model_dir), device="cpu").encode(SENTENCES)
    cosines = (ours * reference).sum(-1) / np.linalg.norm(reference, axis=-1)
    assert cosines.min() >= 0.9999
