"""Embedding throughput side by side: vllm-aot, sentence-transformers and vLLM's own CPU backend
on all-MiniLM-L6-v2 (the bundled embedding model), in one run.

    .venv/bin/python bench/embed_bench.py [--batches 1,32] [--dtype float32]
                                          [--systems ours,st,vllm] [--num-sentences 256]
                                          [--rounds 3]

The same sentences (deterministic, 4 to 60 words: 7 to ~80 tokens) for every system, in
requests of `batch` sentences sent one after another (a warm-up pass first, then the median
of `--rounds` timed passes).
sentence-transformers runs in this process (`encode(batch_size=batch)`: each batch padded to
its longest sentence); ours is `vllm-aot serve --runner pooling` (programs from the compile
cache, compiled on its first start) and vLLM's is the same vLLM with our plugin off
(`VLLM_PLUGINS=none`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), both driven over HTTP
(`/v1/embeddings`), so ours and vLLM's pay the server's round trip that sentence-transformers
does not. `ours-dp2` is `--data-parallel-size 2`: replicas of one core (and one thread) each
behind the proxy; requests still go one at a time. `ours-1t` is one replica whose engine runs
one thread (`--additional-config '{"num_threads": 1}'`). Prints sentences/s per system and batch,
ours against the better of the others, and each system's worst cosine against
sentence-transformers float32.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME, prepare_embedding_model
from vllm_aot.testing import free_port, running_server, vllm_server_command

SYSTEMS = ("ours", "ours-1t", "ours-dp2", "st", "vllm")
_TEXT = (
    "the model maps every sentence to a vector so that similar meanings land close together "
    "while unrelated text ends far apart servers batch requests of many lengths and compiled "
    "programs pad them into fixed buckets paris france capital river bridge quickly brown fox"
)
WORDS = tuple(_TEXT.split(" "))

# (batch of sentences) -> their embeddings [batch, hidden]
Embed = Callable[[list[str]], np.ndarray]


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))).capitalize() + "."
        for _ in range(count)
    ]


def throughput(embed: Embed, texts: list[str], batch: int, rounds: int) -> tuple[float, np.ndarray]:
    """Sentences/s over `texts` in batches, the median of `rounds` timed passes after a
    warm-up pass (every program and code path a pass takes, run once), and every embedding."""
    batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    for part in batches:
        embed(part)
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = np.concatenate([embed(part) for part in batches])
        rates.append(len(texts) / (time.perf_counter() - start))
    return float(np.median(rates)), out


def http_embed(url: str, model: str) -> Embed:
    client = httpx.Client(base_url=url, timeout=600)

    def embed(texts: list[str]) -> np.ndarray:
        response = client.post("/v1/embeddings", json={"model": model, "input": texts})
        response.raise_for_status()
        return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)

    return embed


def server_command(system: str, model_dir: Path, port: int, dtype: str):
    """(command, environment) of a server system."""
    if system.startswith("ours"):
        command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--runner", "pooling",
                   "--dtype", dtype, "--port", str(port)]  # fmt: skip
        if system == "ours-dp2":  # two replicas, one core and one thread each, behind the proxy
            command += ["--data-parallel-size", "2"]
        if system == "ours-1t":  # one engine thread on the two cores (the API server beside it)
            command += ["--additional-config", '{"num_threads": 1}']
        return command, {}
    args = ["--runner", "pooling", "--dtype", dtype, "--served-model-name", EMBEDDING_MODEL_NAME]
    env = {"VLLM_PLUGINS": "none", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
    return vllm_server_command(model_dir, port, args=args), env


def run_system(system: str, model_dir: Path, args, texts: list[str], out_dir: Path) -> dict:
    """batch -> (sentences/s, embeddings) for one system."""
    if system == "st":
        import torch
        from sentence_transformers import SentenceTransformer

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": dtype})
        return {
            b: throughput(lambda t, b=b: model.encode(t, batch_size=b), texts, b, args.rounds)
            for b in args.batches
        }
    port = free_port()
    command, env = server_command(system, model_dir, port, args.dtype)
    log = out_dir / f"{system}-serve.log"
    start = time.perf_counter()
    with running_server(command, port=port, env=env, log_path=log, timeout=900) as url:
        print(f"{system}: up in {time.perf_counter() - start:.1f} s (log {log})", flush=True)
        embed = http_embed(url, EMBEDDING_MODEL_NAME)
        return {b: throughput(embed, texts, b, args.rounds) for b in args.batches}


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


def report(results: dict[str, dict], reference: np.ndarray | None, batches) -> Table:
    table = Table(title="all-MiniLM-L6-v2, sentences/s")
    table.add_column("system")
    for b in batches:
        table.add_column(f"batch {b}", justify="right")
    table.add_column("worst cosine vs ST fp32", justify="right")
    for system, by_batch in results.items():
        cos = cosine_min(by_batch[batches[-1]][1], reference) if reference is not None else None
        row = [f"{by_batch[b][0]:.1f}" for b in batches]
        table.add_row(system, *row, "-" if cos is None else f"{cos:.6f}")
    others = [s for s in results if not s.startswith("ours")]
    for ours in (s for s in results if s.startswith("ours")):
        if not others:
            break
        ratios = []
        for b in batches:
            best = max(results[s][b][0] for s in others)
            ratios.append(f"{results[ours][b][0] / best:.2f}x")
        table.add_row(f"{ours} / best other", *ratios, "")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: s.split(","))
    parser.add_argument("--num-sentences", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="timed passes; the median counts")
    args = parser.parse_args()
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; supported: {', '.join(SYSTEMS)}")
    model_dir = prepare_embedding_model()
    texts = sentences(args.num_sentences)
    out_dir = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    results = {s: run_system(s, model_dir, args, texts, out_dir) for s in args.systems}
    reference = None
    if args.dtype == "float32" and "st" in results:
        reference = results["st"][args.batches[-1]][1]
    Console().print(report(results, reference, args.batches))


if __name__ == "__main__":
    main()
