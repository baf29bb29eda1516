"""`vllm-aot serve --runner pooling` with no model: the bundled all-MiniLM-L6-v2, served offline
through vLLM's embedding, pooling and score endpoints, checked against sentence-transformers."""

from __future__ import annotations

import base64
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME
from vllm_aot.testing import free_port, running_server

SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Sentence embeddings map text to vectors whose cosine similarity tracks meaning, so that "
    "paraphrases land close together and unrelated sentences far apart.",
    "Paris is the capital of France.",
    "What is the capital of France?",
    "x",
]


def serve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--runner", "pooling",
            "--backend", "eager", "--dtype", "float32", "--port", str(port), *args]  # fmt: skip


@pytest.fixture(scope="module")
def reference(embedding_model_dir) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model_dir), device="cpu").encode(SENTENCES)


@pytest.fixture(scope="module")
def server(embedding_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("embed-server") / "serve.log"
    with running_server(serve_command(port), port=port, log_path=log, timeout=300) as url:
        yield url


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embeddings_match_sentence_transformers(client, reference):
    assert [m.id for m in client.models.list().data] == [EMBEDDING_MODEL_NAME]
    response = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=SENTENCES)
    ours = np.array([d.embedding for d in response.data])
    assert ours.shape == (len(SENTENCES), 384)
    assert cosines(ours, reference).min() >= 0.9999
    assert np.linalg.norm(ours, axis=-1) == pytest.approx(1.0, abs=1e-5)  # normalised


def test_concurrent_requests_of_different_lengths_are_batched_alike(client, reference):
    def one(i: int) -> list[float]:
        data = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=SENTENCES[i]).data
        return data[0].embedding

    with ThreadPoolExecutor(len(SENTENCES)) as pool:
        ours = np.array(list(pool.map(one, range(len(SENTENCES)))))
    assert cosines(ours, reference).min() >= 0.9999


def test_base64_embeddings_are_the_float_ones(server, client):
    floats = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=SENTENCES[:2]).data
    body = {"model": EMBEDDING_MODEL_NAME, "input": SENTENCES[:2], "encoding_format": "base64"}
    data = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).json()["data"]
    for encoded, expected in zip(data, floats, strict=True):
        vector = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype=np.float32)
        assert np.array_equal(vector, np.float32(expected.embedding))


def test_pooling_endpoint_returns_the_embedding(server, reference):
    body = {"model": EMBEDDING_MODEL_NAME, "input": SENTENCES[1]}
    response = httpx.post(f"{server}/pooling", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert cosines(response.json()["data"][0]["data"], reference[1]) >= 0.9999


def test_score_is_the_cosine_of_the_embeddings(server, reference):
    body = {"model": EMBEDDING_MODEL_NAME, "text_1": SENTENCES[3], "text_2": SENTENCES[3:5]}
    response = httpx.post(f"{server}/score", json=body, timeout=60)
    assert response.status_code == 200, response.text
    scores = [d["score"] for d in response.json()["data"]]
    assert scores == pytest.approx(cosines(reference[3], reference[3:5]), abs=1e-4)
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 0.95


def test_a_prompt_beyond_the_limit_is_refused_naming_it(server):
    body = {"model": EMBEDDING_MODEL_NAME, "input": "word " * 300}
    response = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400
    assert "maximum context length is 256 tokens" in response.text


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")
def test_two_replicas_serve_embeddings(embedding_model_dir, reference, tmp_path):
    port = free_port()
    command = serve_command(port, "--data-parallel-size", "2")
    with running_server(command, port=port, log_path=tmp_path / "serve.log", timeout=420) as url:
        body = {"model": EMBEDDING_MODEL_NAME, "input": SENTENCES}
        replicas, results = set(), []
        for _ in range(4):
            response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)
            assert response.status_code == 200, response.text
            replicas.add(response.headers["x-vllm-aot-replica"])
            results.append([d["embedding"] for d in response.json()["data"]])
    assert len(replicas) == 2
    for ours in results:
        assert cosines(ours, reference).min() >= 0.9999


def test_the_readme_command_serves_bfloat16_embeddings(reference, tmp_path):
    """`vllm-aot serve --runner pooling` with no --dtype: vLLM's auto on our platform is bfloat16
    (vLLM's CPU backend would pick float16 for an embedding model, which we do not run)."""
    port = free_port()
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--runner", "pooling",
               "--backend", "eager", "--port", str(port)]  # fmt: skip
    log = tmp_path / "serve.log"
    with running_server(command, port=port, log_path=log, timeout=300) as url:
        body = {"model": EMBEDDING_MODEL_NAME, "input": SENTENCES}
        response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)
        assert response.status_code == 200, response.text
        ours = [d["embedding"] for d in response.json()["data"]]
    assert "bfloat16" in log.read_text()
    assert cosines(ours, reference).min() >= 0.999
