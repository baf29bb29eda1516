"""Prometheus metrics of our own, served on vLLM's `/metrics`.

The worker runs in the engine-core process and vLLM's `/metrics` is served by the front end, so
the worker writes its counters to a small JSON file (path chosen by the front end, passed in our
options) and a collector registered in the front end's registry reads it at each scrape.
Series: `vllm_aot:cache_hits_total{tier}`, `vllm_aot:cache_misses_total`,
`vllm_aot:compile_seconds_total`, `vllm_aot:remote_fetch_seconds_total`,
`vllm_aot:program_load_seconds_total`, `vllm_aot:weights_load_seconds_total`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

from vllm_aot.runtime.loader import LoadReport


def write_load_stats(path: str | Path, report: LoadReport) -> None:
    path = Path(path)
    stats = {
        "hits": {tier: report.count(tier) for tier in ("local", "remote", "artifact")},
        "misses": report.count("compiled"),
        "compile_seconds": sum(report.compiled.values()),
        "fetch_seconds": sum(report.fetched.values()),
        "load_seconds": sum(report.loaded.values()),
        "weights_seconds": report.weights_seconds,
    }
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(stats))
    os.replace(staging, path)


def read_stats(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


class LoadStatsCollector:
    """Exposes the worker's start-up counters (zero until the worker has written them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def collect(self):
        stats = read_stats(self.path)
        hits = CounterMetricFamily(
            "vllm_aot:cache_hits", "Compiled programs found in a cache tier", labels=["tier"]
        )
        for tier in ("local", "remote", "artifact"):
            hits.add_metric([tier], stats.get("hits", {}).get(tier, 0))
        yield hits
        for name, key, help_text in (
            ("cache_misses", "misses", "Compiled programs not cached (compiled at start-up)"),
            ("compile_seconds", "compile_seconds", "Seconds spent compiling programs"),
            ("remote_fetch_seconds", "fetch_seconds", "Seconds fetching from the remote store"),
            ("program_load_seconds", "load_seconds", "Seconds loading compiled programs"),
            ("weights_load_seconds", "weights_seconds", "Seconds loading weights"),
        ):
            yield CounterMetricFamily(f"vllm_aot:{name}", help_text, value=stats.get(key, 0))


def register_collector(path: str | Path) -> None:
    """Add the collector to this process's registry (once: a second call is a no-op)."""
    with contextlib.suppress(ValueError):  # already registered in this process
        REGISTRY.register(LoadStatsCollector(path))
