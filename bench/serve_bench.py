"""Serving benchmark: one model copy with all threads vs data-parallel replicas, side by side.

In one run on this machine, through `vllm-aot serve` as a user starts it:

- DP=1 pinned to the cores (2 threads on 2 cores) vs DP=2 behind the proxy (1 core each);
- `vllm bench serve` against each: random 128-token prompts, 128 output tokens (ignore-eos),
  16 concurrent streams: output tokens/s and TTFT (mean, median, p99), TPOT;
- the proxy's own added latency per request: the same request straight to a replica and through
  the proxy, alternated (GET /v1/models, and a 1-token completion), median and p90 difference.

    .venv/bin/python bench/serve_bench.py [MODEL] [--num-prompts 64] [--concurrency 16]

The first inductor start compiles the model's programs into the cache (minutes, once); later
starts load them. `--backend eager` skips compiling (a smoke run, not a performance figure).

The load generator shares the machine's cores with the servers (see docs/benchmarking.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from vllm_aot.cli.main import resolve_model
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.placement import format_core_list, requested_cores
from vllm_aot.testing import free_port, running_server

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")


@dataclass(frozen=True)
class ServeRun:
    label: str
    serve_args: tuple[str, ...]
    is_proxied: bool


@dataclass(frozen=True)
class ServeFigures:
    label: str
    startup_s: float
    num_completed: int
    output_tok_s: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float


@dataclass(frozen=True)
class ProxyLatency:
    request: str
    direct_ms: float  # median
    proxied_ms: float  # median
    added_p90_ms: float  # p90 of (proxied - direct) over alternated pairs


def padding_counters(url: str) -> dict[tuple[str, str, str], float]:
    """Our bucket counters from /metrics: (series, kind, slot) -> value."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    counters = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        if family.name in ("vllm_aot:bucket_rows", "vllm_aot:bucket_tokens"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (family.name.split(":")[1], sample.labels["kind"], sample.labels["slot"])
                    counters[key] = sample.value
    return counters


def padding_waste(before: dict, after: dict) -> str:
    """`decode rows 12 % padding, prefill tokens 30 % padding` for the counters' difference."""
    parts = []
    for series, kind in (("bucket_rows", "decode"), ("bucket_tokens", "prefill")):
        real, pad = (after.get((series, kind, s), 0) - before.get((series, kind, s), 0)
                     for s in ("real", "padding"))  # fmt: skip
        if real + pad:
            what = series.split("_")[1]
            parts.append(f"{kind} {what} {100 * pad / (real + pad):.0f} % padding")
    return ", ".join(parts)


def run_vllm_bench(
    url: str,
    model_dir: Path,
    served_name: str,
    args,
    out_dir: Path,
    tag: str,
    *,
    seed: int = 0,
    extra_args: Sequence[str] = (),
):
    """One `vllm bench serve` run against `url`; its result JSON as a dict.

    `extra_args` go to `vllm bench serve` as they are (a server's quirks: headers, extra body).
    """
    command = [
        sys.executable, str(VLLM_CLI), "bench", "serve", "--backend", "openai",
        "--base-url", url, "--endpoint", "/v1/completions", "--model", served_name,
        "--tokenizer", str(model_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--ignore-eos", "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", f"{tag}.json",
        "--disable-tqdm", *extra_args,
    ]  # fmt: skip
    started = _children_seconds()
    before = None  # the client's CPU seconds when its timed run starts
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out_dir / f"{tag}-client.log", "w") as log:
        client = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for line in client.stdout:
            log.write(line)
            if before is None and line.startswith("Starting main benchmark run"):
                times = psutil.Process(client.pid).cpu_times()
                before = times.user + times.system
        client.wait()
    if client.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed; see {out_dir / f'{tag}-client.log'}")
    result = json.loads((out_dir / f"{tag}.json").read_text())
    # what the load generator took while it streamed (its start-up, ~10 s here, left out)
    result["client_cpu_seconds"] = _children_seconds() - started - (before or 0.0)
    return result


def server_processes(port: int) -> list:
    """The process listening on `port` and all its descendants (vLLM's API server and engine
    core; llama-server alone); none when nothing listens."""
    connections = psutil.net_connections("tcp")
    listeners = [c.pid for c in connections if c.laddr.port == port and c.status == "LISTEN"]
    if not listeners:
        return []
    root = psutil.Process(listeners[0])
    return [root, *root.children(recursive=True)]


def server_memory(port: int) -> float:
    """Proportional set size (MB) of the server on `port`, all its processes: shared pages
    counted once."""
    total = 0
    for process in server_processes(port):
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 1e6


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuShare:
    """CPU time of the server on `port` since construction, beside the load generator's while
    it streamed (`run_vllm_bench`'s `client_cpu_seconds`): on a machine the two share, what the
    client takes comes out of the server's cores."""

    def __init__(self, port: int) -> None:
        self.processes = server_processes(port)
        self.server = self._server_seconds()

    def _server_seconds(self) -> float:
        total = 0.0
        for process in self.processes:
            try:
                times = process.cpu_times()
            except psutil.Error:  # a process that ended: its time is gone with it
                continue
            total += times.user + times.system
        return total

    def summary(self, result: dict, tokens: int) -> str:
        """The shares over the `vllm bench serve` run `result` streaming `tokens`."""
        duration, client = result["duration"], result["client_cpu_seconds"]
        server = self._server_seconds() - self.server
        return (
            f"CPU over {duration:.0f} s on {os.cpu_count()} cores: server {server / duration:.2f} "
            f"cores, load generator {client / duration:.2f} ({1e3 * client / tokens:.2f} ms a "
            "token)"
        )


def time_pairs(direct: str, proxied: str, request: str, num_pairs: int, served_name: str):
    """Alternate the same request direct/proxied on kept-alive connections; ms per request."""
    body = {"model": served_name, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    pairs = []
    with httpx.Client(timeout=60) as client:

        def once(base: str) -> float:
            start = time.perf_counter()
            if request == "GET /v1/models":
                response = client.get(f"{base}/v1/models")
            else:
                response = client.post(f"{base}/v1/completions", json=body)
            response.raise_for_status()
            return (time.perf_counter() - start) * 1000

        once(direct), once(proxied)  # warm connections
        for _ in range(num_pairs):
            pairs.append((once(direct), once(proxied)))
    added = sorted(p - d for d, p in pairs)
    return ProxyLatency(
        request,
        statistics.median(d for d, _ in pairs),
        statistics.median(p for _, p in pairs),
        added[int(0.9 * (len(added) - 1))],
    )


def measure(run: ServeRun, model_dir: Path, served_name: str, args, out_dir: Path):
    port = free_port()
    command = [
        sys.executable, "-m", "vllm_aot.cli.main", "serve",
        *([args.model] if args.model else []), "--port", str(port), "--backend", args.backend,
        *run.serve_args,
    ]  # fmt: skip
    tag = run.label.split(",")[0].replace("=", "").lower()
    start = time.monotonic()
    latencies: list[ProxyLatency] = []
    with running_server(
        command, port=port, log_path=out_dir / f"{tag}-serve.log", timeout=args.start_timeout
    ) as url:
        startup = time.monotonic() - start
        result = run_vllm_bench(url, model_dir, served_name, args, out_dir, tag)
        if run.is_proxied:
            replica_url = httpx.get(f"{url}/health").json()["replicas"][0]["url"]
            for request in ("GET /v1/models", "POST /v1/completions max_tokens=1"):
                latencies.append(
                    time_pairs(replica_url, url, request, args.latency_pairs, served_name)
                )
    figures = ServeFigures(
        run.label,
        startup,
        result["completed"],
        result["output_throughput"],
        result["mean_ttft_ms"],
        result["median_ttft_ms"],
        result["p99_ttft_ms"],
        result["mean_tpot_ms"],
    )
    return figures, latencies


def print_tables(figures: list[ServeFigures], latencies: list[ProxyLatency], args) -> None:
    console = Console(width=max(Console().width, 110))
    title = (
        f"{args.num_prompts} requests, {args.concurrency} concurrent streams, "
        f"{args.input_len} in / {args.output_len} out, ignore-eos"
    )
    table = Table("", *(f.label for f in figures), title=title)
    rows = [
        ("start-up (s)", "startup_s", "{:.0f}"),
        ("completed", "num_completed", "{}"),
        ("output tokens/s", "output_tok_s", "{:.1f}"),
        ("TTFT mean (ms)", "mean_ttft_ms", "{:.0f}"),
        ("TTFT median (ms)", "median_ttft_ms", "{:.0f}"),
        ("TTFT p99 (ms)", "p99_ttft_ms", "{:.0f}"),
        ("TPOT mean (ms)", "mean_tpot_ms", "{:.1f}"),
    ]
    for name, attribute, fmt in rows:
        table.add_row(name, *(fmt.format(getattr(f, attribute)) for f in figures))
    console.print(table)
    table = Table(
        "request", "direct (ms, median)", "via proxy (ms, median)", "added (ms)",
        "added p90 (ms)", title=f"proxy overhead, {args.latency_pairs} alternated pairs, idle",
    )  # fmt: skip
    for lat in latencies:
        table.add_row(
            lat.request,
            f"{lat.direct_ms:.2f}",
            f"{lat.proxied_ms:.2f}",
            f"{lat.proxied_ms - lat.direct_ms:.2f}",
            f"{lat.added_p90_ms:.2f}",
        )
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help=f"default: the bundled {DEFAULT_MODEL_NAME}")
    parser.add_argument("--cores", default=None, help="default: all this process may use")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--latency-pairs", type=int, default=50)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--start-timeout", type=float, default=1800.0, help="compiles if uncached")
    parser.add_argument("--out", type=Path, default=None, help="results and logs (default: tmp)")
    args = parser.parse_args()
    try:
        cores = requested_cores(args.cores)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if len(cores) < 2:
        raise SystemExit("error: the comparison needs at least two cores")
    cores_text = format_core_list(cores)
    model_dir = resolve_model(args.model)
    served_name = DEFAULT_MODEL_NAME if args.model is None else str(model_dir)
    runs = (
        ServeRun(f"DP=1, {len(cores)} threads", ("--cores", cores_text), False),
        ServeRun(
            f"DP=2, {len(cores) // 2} core(s) each",
            ("--data-parallel-size", "2", "--cores", cores_text),
            True,
        ),
    )
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="serve-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"cores {cores_text}, {args.backend}; results and logs in {out_dir}", flush=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    figures, latencies = [], []
    for run in runs:
        print(f"{run.label}: starting", flush=True)
        run_figures, run_latencies = measure(run, model_dir, served_name, args, out_dir)
        figures.append(run_figures)
        latencies += run_latencies
    print_tables(figures, latencies, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
