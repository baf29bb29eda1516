"""Serving performance side by side: vllm-aot against vLLM's own CPU backend, in one run.

    .venv/bin/python bench/perf_bench.py [--concurrency 1,8,32] [--cases 128x128,1024x128]
                                         [--systems ours,vllm] [--dtype bfloat16]

Each system is started once (start-up time recorded), then driven by `vllm bench serve` (random
data, ignore-eos, streaming /v1/completions) for every case and concurrency, with
`--prompts-per-stream` prompts per concurrent stream. Ours is `vllm-aot serve` (programs from the
compile cache); vLLM's is the same vLLM with our plugin off (`VLLM_PLUGINS=none`) at its better
core setting (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`, docs/benchmarking.md). Prints output tok/s, TTFT
and TPOT (mean, p99) per system and our/their ratios. llama.cpp is not driven yet (its server
needs the quirks listed in docs/benchmarking.md); the issue tracks it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console
from rich.table import Table
from serve_bench import run_vllm_bench

from vllm_aot.models.prepare import DEFAULT_MODEL_NAME, prepare_default_model
from vllm_aot.testing import free_port, running_server, vllm_server_command


@dataclass(frozen=True)
class Figures:
    output_tok_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p99_tpot_ms: float


def server(system: str, model: Path, port: int, dtype: str) -> tuple[list[str], dict[str, str]]:
    if system == "ours":
        command = [sys.executable, "-m", "vllm_aot.serve.cli", "serve", "--port", str(port)]
        return [*command, "--dtype", dtype], {}
    args = ["--served-model-name", DEFAULT_MODEL_NAME, "--max-model-len", "2048",
            "--gpu-memory-utilization", "0.5", "--dtype", dtype]  # fmt: skip
    env = {"VLLM_PLUGINS": "none", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
    return vllm_server_command(model, port, args=args), env


def measure(system: str, model: Path, args, out_dir: Path) -> tuple[float, dict]:
    port = free_port()
    command, env = server(system, model, port, args.dtype)
    results = {}
    start = time.monotonic()
    with running_server(
        command, port=port, env=env, log_path=out_dir / f"{system}-serve.log", timeout=1800
    ) as url:
        startup = time.monotonic() - start
        for case in args.cases:
            input_len, output_len = (int(v) for v in case.split("x"))
            for concurrency in args.concurrency:
                bench_args = SimpleNamespace(
                    input_len=input_len,
                    output_len=output_len,
                    num_prompts=max(2, args.prompts_per_stream * concurrency),
                    concurrency=concurrency,
                )
                tag = f"{system}-{case}-c{concurrency}"
                r = run_vllm_bench(url, model, DEFAULT_MODEL_NAME, bench_args, out_dir, tag)
                results[(case, concurrency)] = Figures(
                    r["output_throughput"],
                    r["mean_ttft_ms"],
                    r["p99_ttft_ms"],
                    r["mean_tpot_ms"],
                    r["p99_tpot_ms"],
                )
    return startup, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="ours,vllm")
    parser.add_argument("--cases", default="128x128,1024x128", help="INPUTxOUTPUT,...")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=None, help="results and logs (default: tmp)")
    args = parser.parse_args()
    args.cases = args.cases.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="vllm-aot-perf-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_default_model()
    systems = args.systems.split(",")
    runs = {system: measure(system, model, args, out_dir) for system in systems}
    console = Console(width=160)
    title = f"{DEFAULT_MODEL_NAME} {args.dtype}, vllm bench serve (random, ignore-eos)"
    table = Table("case", "streams", title=title)
    for system in systems:
        for column in ("tok/s", "TTFT mean/p99 ms", "TPOT mean/p99 ms"):
            table.add_column(f"{system} {column}", justify="right")
    if {"ours", "vllm"} <= set(systems):
        table.add_column("tok/s ours/vllm", justify="right")
        table.add_column("TTFT p99 ours/vllm", justify="right")
    for case in args.cases:
        for concurrency in args.concurrency:
            row = [case, str(concurrency)]
            for system in systems:
                f = runs[system][1][(case, concurrency)]
                row += [
                    f"{f.output_tok_s:.1f}",
                    f"{f.mean_ttft_ms:.0f} / {f.p99_ttft_ms:.0f}",
                    f"{f.mean_tpot_ms:.1f} / {f.p99_tpot_ms:.1f}",
                ]
            if {"ours", "vllm"} <= set(systems):
                ours, theirs = (
                    runs["ours"][1][(case, concurrency)],
                    runs["vllm"][1][(case, concurrency)],
                )
                row += [
                    f"{ours.output_tok_s / theirs.output_tok_s:.2f}x",
                    f"{ours.p99_ttft_ms / theirs.p99_ttft_ms:.2f}x",
                ]
            table.add_row(*row)
    console.print(table)
    for system in systems:
        console.print(f"start-up {system}: {runs[system][0]:.0f} s")
    console.print(f"results and logs in {out_dir}")


if __name__ == "__main__":
    main()
