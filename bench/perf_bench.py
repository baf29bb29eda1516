"""Serving performance side by side: vllm-aot, vLLM's own CPU backend and llama.cpp, in one run.

    .venv/bin/python bench/perf_bench.py [--concurrency 1,8,32] [--cases 128x128,1024x128,copy]
                                         [--systems ours,ours-sync,ours-bf16,ours-ngram,
                                                    vllm,llamacpp]
                                         [--serve-args "--max-num-seqs 8"] [--rounds 1]
                                         [--dtype bfloat16] [--num-speculative-tokens K]
                                         [--llamacpp-server native|python] [--gguf PATH]

Each system is started once (start-up: launch to its first successful health request; one
after the other, and all of them stay up), then driven by `vllm bench serve` (random data,
ignore-eos, streaming /v1/completions) for every case and concurrency, with
`--prompts-per-stream` prompts per concurrent stream and one seed per run (the same prompts for
every system, no prompt repeated from an earlier run). Each run goes to every system in turn,
the first one rotating from run to run, so a shared host that slows down during the benchmark
slows every system alike; `--rounds N` repeats every run N times and reports each figure's
median. Ours is `vllm-aot
serve` on the bundled GGUF's blocks (`--quantization gguf`, its default; `ours-bf16`, not run
by default, serves the same weights dequantised to the dtype; `ours-sync`, the GGUF scheduled
synchronously, `--no-async-scheduling`), programs from the compile cache;
vLLM's is the same vLLM with our plugin off
(`VLLM_PLUGINS=none`) at its better core setting (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`,
docs/benchmarking.md); llama.cpp is the build of scripts/setup_llamacpp.sh serving the bundled
GGUF itself (bench/llamacpp.py: which server, its quirks), included by default when built. Prints
output tok/s, TTFT and TPOT (mean, p99) per system and ours/theirs ratios, and for ours the
padding waste of each run (decode rows and prefill tokens, from our counters on /metrics), for
every run the CPU the server and the load generator took (on a small machine the client's share
comes out of the server's cores, and it grows with the tokens a server streams), and
each server's memory (proportional set size of all its processes) after its runs; draws tok/s and
TTFT p99 per system and concurrency into `perf.png` beside the logs (bench/perf_plot.py).

Speculative decoding: `ours-ngram` is ours with `--speculative-config` n-gram drafts
(`NGRAM_CONFIG`, `--num-speculative-tokens` drafts a step); for it every run also prints vLLM's
spec-decode counters (drafts, accepted tokens, acceptance per position). The `copy` case is
copy-heavy: chat requests asking to repeat, correct or continue a given ~190-token paragraph
(`COPY_PROMPTS`, greedy, 128 tokens, ignore-eos), where n-gram drafts match; the random cases
are where they hardly ever do (what speculation costs there).
`--serve-args` go to every `vllm-aot serve` (the same shapes for ours and ours-ngram).

`--gguf PATH`: ours and llama.cpp serve that GGUF file instead of the bundled one (ours as
`vllm-aot serve PATH`; vLLM, which serves HF directories, is left out), e.g. the bigger models of
scripts/build_gguf_models.py. The client tokenises with the bundled model's tokenizer, so the file
must have SmolLM2's vocabulary (those models do).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from copy_case import acceptance, case_args, spec_counters
from llamacpp import BUILD_DIR, KINDS, find_server, gguf_decode_bytes, gguf_file_type
from machine import read_bandwidth_gbs
from perf_plot import draw
from rich.console import Console
from rich.table import Table
from serve_bench import (
    CpuShare,
    padding_counters,
    padding_waste,
    run_vllm_bench,
    server_memory,
)

from vllm_aot.models.prepare import DEFAULT_MODEL_NAME, find_default_gguf, prepare_default_model
from vllm_aot.testing import free_port, running_server, vllm_server_command

SYSTEMS = ("ours", "ours-sync", "ours-bf16", "ours-ngram", "vllm", "llamacpp")
SPEC_SYSTEMS = ("ours-ngram",)
NGRAM_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
DEFAULT_SYSTEMS = ("ours", "vllm", "llamacpp")


@dataclass(frozen=True)
class Figures:
    output_tok_s: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p99_tpot_ms: float


@dataclass(frozen=True)
class Server:
    """One system's server: how to start it, when it is up, how `vllm bench serve` drives it."""

    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    health_path: str = "/health"
    bench_args: tuple[str, ...] = ()  # flags for the server's quirks
    # Its stream has no token count `vllm bench serve` reads, and every request is made to run to
    # max_tokens: count each completed request at that length (see `full_length_figures`).
    is_counted_at_full_length: bool = False


def server(system: str, model: Path, port: int, args) -> Server:
    if system.startswith("ours"):
        command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--port", str(port)]
        command += args.serve_args.split()
        if args.gguf:
            command += [str(args.gguf), "--served-model-name", DEFAULT_MODEL_NAME]
        gguf = ("--quantization", "gguf", "--dtype", args.dtype)
        if system == "ours":  # the bundled GGUF's blocks as they are: serve's default
            return Server((*command, *gguf))
        if system == "ours-sync":  # the same, scheduled synchronously
            return Server((*command, *gguf, "--no-async-scheduling"))
        if system == "ours-ngram":
            k = {"num_speculative_tokens": args.num_speculative_tokens}
            spec = ("--speculative-config", json.dumps(NGRAM_CONFIG | k))
            return Server((*command, *gguf, *spec))
        return Server((*command, "--dtype", args.dtype))  # dequantised to the dtype
    if system == "vllm":
        vllm_args = ["--served-model-name", DEFAULT_MODEL_NAME, "--max-model-len", "2048",
                     "--gpu-memory-utilization", "0.5", "--dtype", args.dtype]  # fmt: skip
        env = (("VLLM_PLUGINS", "none"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
               ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))  # fmt: skip
        return Server(tuple(vllm_server_command(model, port, args=vllm_args)), env)
    llamacpp = args.llamacpp
    command = llamacpp.command(
        served_gguf(args), port, name=DEFAULT_MODEL_NAME, num_slots=max(args.concurrency)
    )
    return Server(
        command=tuple(command),
        env=tuple(llamacpp.env.items()),
        health_path=llamacpp.health_path,
        bench_args=tuple(llamacpp.bench_args(banned_ids=special_token_ids(model))),
        is_counted_at_full_length=True,
    )


def served_gguf(args) -> Path:
    """The GGUF file ours and llama.cpp serve: `--gguf`, else the bundled one."""
    return args.gguf or find_default_gguf()


def bench_title(args) -> str:
    model = args.gguf.name if args.gguf else DEFAULT_MODEL_NAME
    return f"{model}, vllm bench serve (random, ignore-eos)"


def special_token_ids(model: Path) -> list[int]:
    """The tokenizer's special tokens (SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>).

    Banning them forces full-length output where a server ignores `ignore_eos`; none of them
    belongs in the random text a benchmark generates.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).all_special_ids


def full_length_figures(result: dict, output_len: int) -> Figures:
    """Figures of a `--save-detailed` result with every completed request at `output_len` tokens.

    Without a usage count `vllm bench serve` counts output tokens by re-tokenising the streamed
    text, which undercounts sampled text (llama.cpp smoke runs here: by up to 13 % of a run, by
    half of one request), so it understates tok/s and overstates TPOT. TPOT is computed as
    vLLM computes it: (latency - TTFT) / (tokens - 1).
    """
    done = [i for i, error in enumerate(result["errors"]) if not error]
    ttfts = np.array([result["ttfts"][i] for i in done])
    tpots = (np.array([result["latencies"][i] for i in done]) - ttfts) / (output_len - 1)
    return Figures(
        output_tok_s=len(done) * output_len / result["duration"],
        mean_ttft_ms=np.mean(ttfts) * 1000,
        p99_ttft_ms=np.percentile(ttfts, 99) * 1000,
        mean_tpot_ms=np.mean(tpots) * 1000,
        p99_tpot_ms=np.percentile(tpots, 99) * 1000,
    )


@dataclass(frozen=True)
class Running:
    """A started server: its URL, how it is driven, its start-up seconds and port."""

    url: str
    spec: Server
    startup: float
    port: int


def start(system: str, model: Path, args, out_dir: Path, stack: contextlib.ExitStack) -> Running:
    """Start one system's server (kept up until `stack` closes) and time its start-up."""
    port = free_port()
    spec = server(system, model, port, args)
    begin = time.monotonic()
    url = stack.enter_context(
        running_server(
            spec.command,
            port=port,
            env=dict(spec.env),
            log_path=out_dir / f"{system}-serve.log",
            timeout=1800,
            health_path=spec.health_path,
        )
    )
    return Running(url, spec, time.monotonic() - begin, port)


def run_once(system: str, server_: Running, model: Path, run: tuple, seed: int, args, out_dir):
    """One case at one concurrency on one running system: its figures."""
    (case, concurrency), url, spec = run, server_.url, server_.spec
    num_prompts = max(2, args.prompts_per_stream * concurrency)
    input_len, output_len, case_extra = case_args(case, num_prompts, out_dir)
    bench_args = SimpleNamespace(
        input_len=input_len, output_len=output_len, num_prompts=num_prompts, concurrency=concurrency
    )
    tag = f"{system}-{case}-c{concurrency}-s{seed}"
    detailed = ("--save-detailed",) if spec.is_counted_at_full_length else ()
    counters = padding_counters(url) if system.startswith("ours") else {}
    drafts = spec_counters(url) if system in SPEC_SYSTEMS else {}
    cpu = CpuShare(server_.port)
    r = run_vllm_bench(
        url, model, DEFAULT_MODEL_NAME, bench_args, out_dir, tag,
        seed=seed, extra_args=(*spec.bench_args, *detailed, *case_extra),
    )  # fmt: skip
    print(f"{tag}: {cpu.summary(r, num_prompts * output_len)}")
    if spec.is_counted_at_full_length:
        figures = full_length_figures(r, output_len)
        print(
            f"{tag}: {r['completed']} requests counted at {output_len} tokens each "
            f"(re-tokenising their text gives {r['total_output_tokens']} in all)"
        )
    else:
        figures = Figures(
            output_tok_s=r["output_throughput"],
            mean_ttft_ms=r["mean_ttft_ms"],
            p99_ttft_ms=r["p99_ttft_ms"],
            mean_tpot_ms=r["mean_tpot_ms"],
            p99_tpot_ms=r["p99_tpot_ms"],
        )
    print(f"{tag}: {figures.output_tok_s:.1f} tok/s", flush=True)
    if system.startswith("ours"):
        time.sleep(1.5)  # the worker writes its counters about once a second
        print(f"{tag}: {padding_waste(counters, padding_counters(url))}")
    if system in SPEC_SYSTEMS:
        print(f"{tag}: {acceptance(drafts, spec_counters(url))}")
    return figures


def median_figures(samples: list[Figures]) -> Figures:
    """Each figure's median over the rounds."""
    names = [field.name for field in fields(Figures)]
    return Figures(*(statistics.median(getattr(f, name) for f in samples) for name in names))


def measure_all(systems: list[str], model: Path, args, out_dir: Path) -> dict:
    """Every system's server up at once; each run (case, concurrency) on every system in turn,
    the order rotating from run to run and round to round, so a host that drifts during the
    benchmark moves every system alike. Per system: (start-up, {run: median figures}, memory)."""
    runs = list(itertools.product(args.cases, args.concurrency))
    samples: dict = {system: {run: [] for run in runs} for system in systems}
    with contextlib.ExitStack() as stack:
        servers = {system: start(system, model, args, out_dir, stack) for system in systems}
        for round_ in range(args.rounds):
            for i, run in enumerate(runs):
                seed = round_ * len(runs) + i  # the same prompts for every system, never repeated
                turn = (round_ + i) % len(systems)
                for system in systems[turn:] + systems[:turn]:
                    figures = run_once(system, servers[system], model, run, seed, args, out_dir)
                    samples[system][run].append(figures)
        memory = {system: server_memory(servers[system].port) for system in systems}
    return {
        system: (
            servers[system].startup,
            {run: median_figures(samples[system][run]) for run in runs},
            memory[system],
        )
        for system in systems
    }


def choose_systems(args) -> list[str]:
    """`--systems`, or ours and vLLM plus llama.cpp when it is built; refuses what cannot run."""
    if args.systems is None:
        systems = [s for s in DEFAULT_SYSTEMS if not (args.gguf and s == "vllm")]
        if args.llamacpp is None:
            print(f"llamacpp skipped: no build in {BUILD_DIR} (scripts/setup_llamacpp.sh)")
            return [s for s in systems if s != "llamacpp"]
        return systems
    systems = args.systems.split(",")
    if args.gguf and "vllm" in systems:
        raise SystemExit("error: vllm serves HF directories, not --gguf: leave it out of --systems")
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"error: unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if "llamacpp" in systems and args.llamacpp is None:
        which = f"{args.llamacpp_server} " if args.llamacpp_server else ""
        raise SystemExit(
            f"error: no {which}llama.cpp build in {BUILD_DIR}: run scripts/setup_llamacpp.sh"
        )
    return systems


def print_table(runs: dict, systems: list[str], args) -> None:
    console = Console(width=200)
    gguf = served_gguf(args)
    table = Table("case", "streams", title=bench_title(args))
    for system in systems:
        for column in ("tok/s", "TTFT mean/p99 ms", "TPOT mean/p99 ms"):
            table.add_column(f"{system} {column}", justify="right")
    peers = [system for system in systems if system != "ours"] if "ours" in systems else []
    for peer in peers:
        table.add_column(f"tok/s ours/{peer}", justify="right")
        table.add_column(f"TTFT p99 ours/{peer}", justify="right")
    for case, concurrency in itertools.product(args.cases, args.concurrency):
        figures = {system: runs[system][1][(case, concurrency)] for system in systems}
        row = [case, str(concurrency)]
        for f in figures.values():
            row += [
                f"{f.output_tok_s:.1f}",
                f"{f.mean_ttft_ms:.0f} / {f.p99_ttft_ms:.0f}",
                f"{f.mean_tpot_ms:.1f} / {f.p99_tpot_ms:.1f}",
            ]
        ours = figures.get("ours")
        for peer in peers:
            row += [
                f"{ours.output_tok_s / figures[peer].output_tok_s:.2f}x",
                f"{ours.p99_ttft_ms / figures[peer].p99_ttft_ms:.2f}x",
            ]
        table.add_row(*row)
    console.print(table)
    for system in systems:
        weights = f"{args.dtype}, dequantised from the GGUF"
        if system in ("ours", *SPEC_SYSTEMS):
            weights = f"the GGUF's blocks ({gguf_file_type(gguf)}), {args.dtype} compute"
        if system == "llamacpp":
            weights = f"{args.llamacpp.label}, the GGUF itself ({gguf_file_type(gguf)})"
        startup, _, memory = runs[system]
        console.print(
            f"{system}: {weights}; start-up {startup:.1f} s; "
            f"server memory {memory:.0f} MB (PSS, all its processes)"
        )


def print_decode_floor(runs: dict, systems: list[str], args) -> None:
    """Each system's one-stream decode rate (1 / mean TPOT) beside the bandwidth floor: the
    GGUF's weights read once a token at this machine's read bandwidth."""
    if 1 not in args.concurrency:
        return
    weights, bandwidth = gguf_decode_bytes(served_gguf(args)), read_bandwidth_gbs()
    floor = bandwidth * 1e9 / weights
    print(
        f"decode floor: {weights / 1e9:.3f} GB of weights a token at {bandwidth:.1f} GB/s read "
        f"bandwidth: at most {floor:.1f} tok/s for one stream"
    )
    for system, case in itertools.product(systems, args.cases):
        rate = 1000 / runs[system][1][(case, 1)].mean_tpot_ms
        print(f"  {system} {case}, 1 stream: {rate:.1f} tok/s decode ({100 * rate / floor:.0f} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=None, help="default: ours,vllm + llamacpp if built")
    parser.add_argument("--cases", default="128x128,1024x128", help="INPUTxOUTPUT,...")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case; medians")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--serve-args", default="", help="extra flags for every vllm-aot serve")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts a step")
    parser.add_argument(
        "--llamacpp-server", choices=KINDS, default=None, help="default: native if built"
    )
    parser.add_argument("--gguf", type=Path, default=None, help="serve this GGUF (ours, llamacpp)")
    parser.add_argument("--out", type=Path, default=None, help="results and logs (default: tmp)")
    args = parser.parse_args()
    args.cases = args.cases.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.llamacpp = find_server(args.llamacpp_server)
    systems = choose_systems(args)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="vllm-aot-perf-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_default_model()
    runs = measure_all(systems, model, args, out_dir)
    print_table(runs, systems, args)
    print_decode_floor(runs, systems, args)
    results = {system: runs[system][1] for system in systems}
    plot = draw(results, args.cases, args.concurrency, bench_title(args), out_dir / "perf.png")
    print(f"plot: {plot}")
    print(f"results and logs in {out_dir}")


if __name__ == "__main__":
    main()
