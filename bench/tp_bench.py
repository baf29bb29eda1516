"""Tensor parallelism on this machine: decode and prefill speed at TP=1 and TP=2, side by side.

SmolLM2 itself splits only by 3 (9 heads, 3 KV heads), so this builds a random model of its
shapes with 8 heads and 4 KV heads (hidden 576, 30 layers, intermediate 1536, vocabulary 49152,
tied head: the same weight bytes) and runs it in the runtime on 1 and 2 local ranks
(`runtime/ranks.py`, a gloo group between them, each rank on its share of the cores), compiled
programs in bfloat16. Prints decode tokens/s at batch 1 and 8, prefill tokens/s of a 128-token
prompt, and TP=2 / TP=1. The runtime's ranks meet through gloo; a server's meet through vLLM's
CPU communicator (shared memory), so the same model is also served (`vllm-aot serve
--tensor-parallel-size 1 | 2`, the same shapes) and timed with 1 and 8 concurrent streams of
64 output tokens (output tokens/s over the wall time).

    .venv/bin/python bench/tp_bench.py [--steps 32] [--quantization int8] [--no-serve]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table
from runtime_bench import PROMPT_LEN, time_ours_decode, time_ours_prefill

from vllm_aot.loading.startup import load_model
from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.models.tiny import make_tiny_model
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.ranks import run_ranks
from vllm_aot.testing import free_port, running_server

SHAPE = {
    "cls": "LlamaConfig",
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 72,
    "intermediate_size": 1536,
}
BATCHES = (1, 8)
SERVED_TOKENS = 64


def _served(model_dir: Path, fields: dict, tp: int, log: Path) -> dict:
    """Output tokens/s of 1 and 8 concurrent greedy streams through `vllm-aot serve`."""
    import openai

    port = free_port()
    extra = {k: fields[k] for k in ("decode_batch_buckets", "decode_context_buckets")}
    extra |= {k: fields[k] for k in ("prefill_token_buckets", "prefill_context_buckets")}
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(model_dir), "--port",
               str(port), "--tensor-parallel-size", str(tp), "--batch-size", "8",
               "--max-model-len", str(fields["max_model_len"]), "--dtype", fields["dtype"],
               "--max-num-batched-tokens", str(fields["max_num_batched_tokens"]),
               "--served-model-name", "m", "--additional-config", json.dumps(extra)]  # fmt: skip
    if fields["quantization"]:
        command += ["--quantization", fields["quantization"]]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    results = {}
    with running_server(command, port=port, env=env, log_path=log, timeout=1200) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        def stream(salt: int) -> int:
            out = client.completions.create(
                model="m",
                prompt=[(31 * i + 7 * salt) % 40000 + 100 for i in range(PROMPT_LEN)],
                max_tokens=SERVED_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return out.usage.completion_tokens

        stream(0)  # warm-up
        for streams in BATCHES:
            start = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                total = sum(pool.map(stream, range(streams)))
            results[f"served_{streams}"] = total / (time.perf_counter() - start)
    return results


def _measure(rank: int, model_dir: str, fields: dict, steps: int) -> dict:
    model, report = load_model(model_dir, RuntimeConfig(**fields), rank=rank, show_progress=False)
    prefill = [time_ours_prefill(model, PROMPT_LEN, 5) for _ in range(3)]
    results = {"prefill": statistics.median(prefill), "weights_mb": report.weights_bytes / 1e6}
    for batch in BATCHES:
        results[f"decode_b{batch}"] = time_ours_decode(model, batch, steps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch")
    parser.add_argument("--quantization", default=None, choices=["int8"])
    parser.add_argument("--no-serve", action="store_true", help="the runtime's figures only")
    args = parser.parse_args()
    console = Console()
    fields = dict(
        dtype="bfloat16",
        quantization=args.quantization,
        max_num_seqs=8,
        max_model_len=512,
        max_num_batched_tokens=PROMPT_LEN,
        decode_batch_buckets=BATCHES,
        decode_context_buckets=(256, 512),
        prefill_token_buckets=(PROMPT_LEN,),
        prefill_context_buckets=(0, 512),
    )
    with tempfile.TemporaryDirectory(prefix="vllm-aot-tp-bench-") as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "smollm2-shaped",
            tokenizer_dir=prepare_default_model(),
            num_layers=30,
            hidden_size=576,
            spec=SHAPE,
        )
        figures = {}
        for tp in (1, 2):
            console.print(f"TP={tp}: compiling (cached after the first run) and measuring ...")
            start = time.perf_counter()
            ranks = run_ranks(
                _measure, tp, str(model_dir), {**fields, "tensor_parallel_size": tp}, args.steps
            )
            figures[tp] = ranks[0]
            if not args.no_serve:
                log = Path(tmp) / f"serve-tp{tp}.log"
                figures[tp] |= _served(model_dir, fields, tp, log)
            console.print(f"  {time.perf_counter() - start:.0f} s")
    table = Table(title=f"SmolLM2-shaped random Llama, bfloat16, {len(os.sched_getaffinity(0))} "
                  "cores; tokens/s")  # fmt: skip
    for column in ("", "TP=1", "TP=2", "TP=2 / TP=1"):
        table.add_column(column, justify="right")
    rows = [(f"decode batch {b}", f"decode_b{b}") for b in BATCHES]
    if not args.no_serve:
        rows += [(f"served, {b} streams", f"served_{b}") for b in BATCHES]
    for label, key in [(f"prefill {PROMPT_LEN} tokens", "prefill"), *rows]:
        one, two = figures[1][key], figures[2][key]
        table.add_row(label, f"{one:.1f}", f"{two:.1f}", f"{two / one:.2f}x")
    weights = [f"{figures[tp]['weights_mb']:.0f}" for tp in (1, 2)]
    table.add_row("weights per rank (MB)", *weights)
    console.print(table)


if __name__ == "__main__":
    main()
