"""Prometheus metrics of our own, served on vLLM's `/metrics`.

The worker runs in the engine-core process and vLLM's `/metrics` is served by the front end, so
the worker keeps its counters in one small JSON file (path chosen by the front end, passed in our
options; `StatsFile`) and a collector registered in the front end's registry reads it at each
scrape (`StatsCollector`). The file is `stats-<front end pid>.json` in this user's private
runtime directory (`new_stats_path`: mode 0700, files of processes gone removed at start); a
file that cannot be read or makes no sense gives zeros and one warning, never a broken
`/metrics`. The file is rewritten whole, staged then renamed: at start-up, then by
a background thread at most once a second while the counters change, and once when the worker
shuts down (if vLLM lets it: its default `--shutdown-timeout 0` kills the engine, and the front
end goes with it). A scrape lags the engine by up to a second.

The configuration: `vllm_aot:configuration_info{dtype,weights,kv_cache_dtype}` (1), e.g.
`weights="q4_1 (embed_tokens, lm_head: q8_0)"` for the bundled GGUF.

Start-up (compile cache):
- `vllm_aot:cache_hits_total{tier="local|remote|artifact"}`, `vllm_aot:cache_misses_total`;
- `vllm_aot:compile_seconds_total`, `vllm_aot:remote_fetch_seconds_total`,
  `vllm_aot:program_load_seconds_total`, `vllm_aot:weights_load_seconds_total`.

Steps (what the buckets cost; `kind` is `prefill`, `decode`, `verify` (speculative decoding:
its tokens are every row's newest and drafts, padded to k + 1 a row) or `encode`, `slot` is
`real` or `padding`; vLLM's own `vllm:spec_decode_*` series count drafts and acceptances):
- `vllm_aot:program_executions_total{program,kind}`: runs per compiled program, zeros included
  (an unused bucket shows as 0). A layer program counts once per layer pass (it runs once per
  decoder layer within it); a head program (`greedy`/`sample`/`verify_greedy`/`verify_sample`
  kinds) once per head run;
- `vllm_aot:bucket_rows_total{kind,slot}`: sequences vs padded rows of the row bucket (prefill:
  the head's row bucket; decode: the batch bucket);
- `vllm_aot:bucket_tokens_total{kind,slot}`: tokens vs padded tokens of the token bucket
  (decode: one token per row, so the batch bucket again);
- `vllm_aot:context_tokens_total{kind,slot}`: cached tokens real rows attend to vs cached-token
  slots read and masked (prefill: the context bucket `C` per pass; decode: `B * C` per pass);
- `vllm_aot:padding_fraction{kind}`: histogram of each layer pass's padded share of its token
  bucket (buckets 0, 0.1, 0.25, 0.5, 0.75, 1);
- `vllm_aot:step_seconds_total{part}`: where the worker's time goes: `layer_programs` (the
  layer loop's 30 program calls), `head_programs`, `host` (the rest of its step calls: input
  preparation, the K/V write, bookkeeping, host-side logits processing) and `between_steps`
  (synchronous scheduling: vLLM's engine loop; async: the step thread waiting for work).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from vllm_aot.files import private_dir, remove_staging_leftovers, write_json_atomic
from vllm_aot.loading.program_sources import LoadReport
from vllm_aot.paths import runtime_dir
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.step_stats import LAYER_KINDS

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it

WRITE_INTERVAL_S = 1.0
_SLOTS = ("real", "padding")
_STEP_PARTS = ("layer_programs", "head_programs", "host", "between_steps")


def load_stats(report: LoadReport, config: RuntimeConfig) -> dict[str, Any]:
    return {
        "configuration": {
            "dtype": config.dtype,
            "weights": config.formats_summary(),
            "kv_cache_dtype": config.kv_cache_dtype,
        },
        "hits": {tier: report.count(tier) for tier in ("local", "remote", "artifact")},
        "misses": report.count("compiled"),
        "compile_seconds": sum(report.compiled.values()),
        "fetch_seconds": sum(report.fetched.values()),
        "load_seconds": sum(report.loaded.values()),
        "weights_seconds": report.weights_seconds,
    }


class StepClock:
    """Where the worker's time goes: inside its step calls (`execute_model`, `sample_tokens`)
    and between them while requests run (vLLM's engine loop when scheduling is synchronous;
    under async scheduling the step thread waiting for work). A gap with no request running is
    the engine idle, not counted."""

    def __init__(self) -> None:
        self.step_seconds = 0.0
        self.between_seconds = 0.0
        self._last_end: float | None = None

    @contextlib.contextmanager
    def timed(self, *, is_running: bool) -> Iterator[None]:
        """Time a step call; `is_running`: requests were running since the previous one."""
        start = time.perf_counter()
        if is_running and self._last_end is not None:
            self.between_seconds += start - self._last_end
        try:
            yield
        finally:
            self._last_end = time.perf_counter()
            self.step_seconds += self._last_end - start


def model_stats(model: CompiledModel, clock: StepClock | None = None) -> dict[str, Any]:
    """The step counters of a running model, JSON-ready; safe to call from another thread
    (the model's counter dicts never change keys)."""
    executions = list(model.num_executions.items())
    layers, head = model.program_seconds["layers"], model.program_seconds["head"]
    seconds = {"layer_programs": layers, "head_programs": head}
    if clock is not None:
        seconds["host"] = max(0.0, clock.step_seconds - layers - head)
        seconds["between_steps"] = clock.between_seconds
    return {
        "programs": [
            {"program": key.name, "kind": key.kind.value, "executions": count}
            for key, count in sorted(executions)
        ],
        "steps": model.step_stats.to_dict(),
        "seconds": seconds,
    }


class StatsFile:
    """The worker's counters on disk, for `StatsCollector` in the front end.

    `__init__` writes the start-up counters at once. `follow(snapshot)` starts a daemon thread
    that calls `snapshot()` (the step counters) every `interval` seconds and rewrites the file
    when they changed; the stepping thread pays nothing. `close` stops the thread and writes a
    last time. A failed write is logged and retried at the next interval.
    """

    def __init__(self, path: str | Path, load: dict[str, Any]) -> None:
        self.path = Path(path)
        self._load = load
        self._snapshot: Callable[[], dict[str, Any]] | None = None
        self._written: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write({})

    def follow(
        self, snapshot: Callable[[], dict[str, Any]], interval: float = WRITE_INTERVAL_S
    ) -> None:
        assert self._thread is None, "StatsFile already follows a model"
        self._snapshot = snapshot
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="vllm-aot-stats", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop following and write the final counters (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._write_if_changed()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._write_if_changed()

    def _write_if_changed(self) -> None:
        assert self._snapshot is not None
        steps = self._snapshot()
        if steps != self._written:
            self._write(steps)

    def _write(self, steps: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.path, {"load": self._load, **steps})
        except OSError as exc:
            logger.warning("vllm-aot: could not write the stats file %s: %s", self.path, exc)
            return
        self._written = steps


def new_stats_path() -> Path | None:
    """Where this front end's engine reports its counters (removed at exit): in this user's
    private runtime directory, whose files of processes gone (killed) are removed first. None,
    with a warning, where that directory cannot be had: no engine stats then."""
    try:
        directory = private_dir(runtime_dir() / "stats")
    except OSError as exc:
        logger.warning("vllm-aot: no engine stats on /metrics: %s (VLLM_AOT_RUNTIME_DIR)", exc)
        return None
    remove_stale_stats(directory)
    path = directory / f"stats-{os.getpid()}.json"
    atexit.register(path.unlink, missing_ok=True)
    return path


def remove_stale_stats(directory: Path) -> list[Path]:
    """Remove the stats files in `directory` (and their staging leftovers) whose front end is
    gone; returns the files."""
    stale = []
    for path in directory.glob("stats-*.json"):
        pid = path.stem.removeprefix("stats-")
        if pid.isdigit() and not _is_running(int(pid)):
            remove_staging_leftovers(path)
            path.unlink(missing_ok=True)
            stale.append(path)
    return stale


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def read_stats(path: str | Path) -> dict[str, Any]:
    """The stats file's counters; {} where it is missing or no JSON object."""
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _slot_family(name: str, help_text: str, steps: dict, field: str) -> CounterMetricFamily:
    family = CounterMetricFamily(f"vllm_aot:{name}", help_text, labels=["kind", "slot"])
    for kind in LAYER_KINDS:
        counts = steps.get(kind, {}).get(field, {})
        for slot in _SLOTS:
            family.add_metric([kind, slot], counts.get(slot, 0))
    return family


def _padding_histogram(steps: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "vllm_aot:padding_fraction",
        "Padded share of each layer pass's token bucket",
        labels=["kind"],
    )
    for kind in LAYER_KINDS:
        histogram = steps.get(kind, {}).get("padding_fraction")
        if histogram is None:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip(histogram["bounds"], histogram["counts"], strict=True):
            cumulative += count
            buckets.append((str(bound), cumulative))
        buckets.append(("+Inf", cumulative))
        family.add_metric([kind], buckets, sum_value=histogram["sum"])
    return family


def _step_families(stats: dict[str, Any]) -> Iterator[Metric]:
    programs = CounterMetricFamily(
        "vllm_aot:program_executions",
        "Runs per compiled program: layer passes (each over every layer) or head runs",
        labels=["program", "kind"],
    )
    for program in stats.get("programs", []):
        programs.add_metric([program["program"], program["kind"]], program["executions"])
    yield programs
    steps = stats.get("steps", {})
    yield _slot_family(
        "bucket_rows", "Sequences in layer passes vs padded rows of the bucket", steps, "rows"
    )
    yield _slot_family(
        "bucket_tokens", "Tokens in layer passes vs padded tokens of the bucket", steps, "tokens"
    )
    yield _slot_family(
        "context_tokens",
        "Cached tokens attended to vs cached-token slots read and masked by layer passes",
        steps,
        "context_tokens",
    )
    yield _padding_histogram(steps)
    seconds = CounterMetricFamily(
        "vllm_aot:step_seconds",
        "Where the worker's time goes: inside layer and head programs, its own host work "
        "around them, and between its step calls",
        labels=["part"],
    )
    for part in _STEP_PARTS:
        seconds.add_metric([part], stats.get("seconds", {}).get(part, 0.0))
    yield seconds


def _load_families(load: dict[str, Any]) -> Iterator[Metric]:
    if "configuration" in load:
        info = InfoMetricFamily(
            "vllm_aot:configuration", "What the programs compute with: dtype, weights, KV"
        )
        info.add_metric([], load["configuration"])
        yield info
    hits = CounterMetricFamily(
        "vllm_aot:cache_hits", "Compiled programs found in a cache tier", labels=["tier"]
    )
    for tier in ("local", "remote", "artifact"):
        hits.add_metric([tier], load.get("hits", {}).get(tier, 0))
    yield hits
    for name, key, help_text in (
        ("cache_misses", "misses", "Compiled programs not cached (compiled at start-up)"),
        ("compile_seconds", "compile_seconds", "Seconds spent compiling programs"),
        ("remote_fetch_seconds", "fetch_seconds", "Seconds fetching from the remote store"),
        ("program_load_seconds", "load_seconds", "Seconds loading compiled programs"),
        ("weights_load_seconds", "weights_seconds", "Seconds loading weights"),
    ):
        yield CounterMetricFamily(f"vllm_aot:{name}", help_text, value=load.get(key, 0))


def _families(stats: dict[str, Any]) -> list[Metric]:
    families = [*_load_families(stats.get("load", {})), *_step_families(stats)]
    for family in families:  # what the exposition will need of each sample
        for sample in family.samples:
            float(sample.value)
            if not all(isinstance(v, str) for v in sample.labels.values()):
                raise TypeError(f"a label of {sample.name} is no string: {sample.labels}")
    return families


class StatsCollector:
    """Exposes the worker's counters (zero until the worker has written them, and where the
    file makes no sense: with one warning)."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self._is_warned = False

    def collect(self) -> Iterator[Metric]:
        try:
            families = _families(read_stats(self.path))
        except Exception as exc:  # a broken or forged file: zeros, never a broken /metrics
            if not self._is_warned:
                logger.warning("vllm-aot: engine stats in %s unreadable: %r", self.path, exc)
                self._is_warned = True
            families = _families({})
        yield from families


def register_collector(path: str | Path | None) -> None:
    """Add the collector to this process's registry (once: a second call is a no-op; none
    without a path)."""
    if path is None:
        return
    with contextlib.suppress(ValueError):  # already registered in this process
        REGISTRY.register(StatsCollector(path))
