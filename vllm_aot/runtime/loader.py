"""Model directory + RuntimeConfig -> CompiledModel, with programs from the compile cache."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.models.config import ModelArch
from vllm_aot.models.registry import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.backends import Program, compile_programs, eager_program, load_program
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import ProgramKey, all_program_keys

logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What start-up did, per program: where it came from and how long it took."""

    sources: dict[str, str] = field(default_factory=dict)  # local | remote | compiled | artifact
    seconds: dict[str, float] = field(default_factory=dict)  # to look up, fetch or compile each
    loaded: dict[str, float] = field(default_factory=dict)  # load seconds (every program)
    weights_seconds: float = 0.0
    weights_bytes: int = 0

    def record(self, name: str, source: str, seconds: float = 0.0) -> None:
        self.sources[name] = source
        self.seconds[name] = seconds

    def count(self, source: str) -> int:
        return sum(s == source for s in self.sources.values())

    def _seconds_of(self, source: str) -> dict[str, float]:
        return {n: self.seconds[n] for n, s in self.sources.items() if s == source}

    @property
    def compiled(self) -> dict[str, float]:
        """Compile seconds of the programs this start compiled."""
        return self._seconds_of("compiled")

    @property
    def fetched(self) -> dict[str, float]:
        """Fetch seconds of the programs taken from the remote store."""
        return self._seconds_of("remote")

    def summary(self) -> str:
        origin = ", ".join(
            f"{self.count(s)} {label}"
            for s, label in (
                ("local", "from the local cache"),
                ("remote", "fetched from the remote store"),
                ("compiled", "compiled"),
                ("artifact", "from the exported directory"),
            )
            if self.count(s)
        )
        return (
            f"{len(self.loaded)} programs loaded in {sum(self.loaded.values()):.2f} s"
            f"{f' ({origin})' if origin else ''}; compile {sum(self.compiled.values()):.1f} s, "
            f"fetch {sum(self.fetched.values()):.2f} s; weights {self.weights_bytes / 1e6:.0f} MB "
            f"in {self.weights_seconds:.2f} s"
        )


def default_num_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def ensure_programs(
    arch: ModelArch,
    config: RuntimeConfig,
    report: LoadReport,
    *,
    cache: ProgramCache | None = None,
    allow_compile: bool = True,
    num_workers: int | None = None,
    show_progress: bool = True,
    on_event: Callable[[str, str, float], None] | None = None,
) -> dict[ProgramKey, Path]:
    """Every program of `config` from the compile cache (local, remote) or compiled into it.

    Records each program in `report`; `on_event(name, source, seconds)` per program.
    Raises CacheMissError when a program is missing and `allow_compile` is False.
    """
    from tqdm import tqdm

    cache = cache or ProgramCache(CacheSettings.from_env())
    bars: list[tqdm] = []

    def compile_fn(jobs, on_done) -> None:
        bars.append(tqdm(desc="compiling programs", total=len(jobs), disable=not show_progress))

        def done(key: ProgramKey, seconds: float) -> None:
            on_done(key, seconds)
            bars[-1].update()

        compile_programs(
            jobs, arch, config, num_workers=num_workers or default_num_workers(), on_done=done
        )

    def event(name: str, source: str, seconds: float) -> None:
        report.record(name, source, seconds)
        if on_event is not None:
            on_event(name, source, seconds)

    try:
        outcome = cache.ensure(
            arch, config, compile_fn=compile_fn if allow_compile else None, on_event=event
        )
    finally:
        for bar in bars:
            bar.close()
    return outcome.paths


def load_programs(
    arch: ModelArch,
    config: RuntimeConfig,
    program_paths: dict[ProgramKey, Path] | None,
    report: LoadReport,
) -> dict[ProgramKey, Program]:
    """Every program of `config`: eager modules, or the compiled packages at `program_paths`."""
    keys = all_program_keys(config)
    if config.backend == "eager":
        return {key: eager_program(key, arch, config) for key in keys}
    assert program_paths is not None, "the inductor backend loads compiled programs"
    programs = {}
    for key in keys:
        start = time.perf_counter()
        programs[key] = load_program(program_paths[key], config)
        report.loaded[key.name] = time.perf_counter() - start
    return programs


def load_weights_timed(model_dir: str | Path, arch: ModelArch, config: RuntimeConfig, report):
    start = time.perf_counter()
    weights = load_weights(model_dir, arch, config.torch_dtype)
    report.weights_seconds = time.perf_counter() - start
    report.weights_bytes = weights.num_bytes()
    return weights


def load_model(
    model_dir: str | Path,
    config: RuntimeConfig,
    *,
    cache: ProgramCache | None = None,
    num_workers: int | None = None,
    show_progress: bool = True,
) -> tuple[CompiledModel, LoadReport]:
    """Load weights and programs (from the compile cache, compiling missing ones)."""
    arch = load_arch(model_dir)
    check_fits(arch, config)
    report = LoadReport()
    paths = None
    if config.backend == "inductor":
        paths = ensure_programs(
            arch,
            config,
            report,
            cache=cache,
            num_workers=num_workers,
            show_progress=show_progress,
        )
    programs = load_programs(arch, config, paths, report)
    weights = load_weights_timed(model_dir, arch, config, report)
    logger.info("model ready: %s", report.summary())
    return CompiledModel(arch, config, weights, programs), report


def check_fits(arch: ModelArch, config: RuntimeConfig) -> None:
    """Refuse configurations the model cannot honour, naming the limit."""
    if config.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    if arch.sliding_window is not None and arch.sliding_window < config.max_model_len:
        raise ValueError(
            f"{arch.architecture} uses a sliding window of {arch.sliding_window} tokens, which "
            f"vllm-aot does not implement; use max_model_len <= {arch.sliding_window}"
        )
