"""Model directory + RuntimeConfig -> CompiledModel, compiling only the programs not yet built."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import vllm_aot
from vllm_aot import paths
from vllm_aot.models.config import ModelArch
from vllm_aot.models.registry import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.backends import Program, compile_programs, eager_program, load_program
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import ProgramKey, all_program_keys

logger = logging.getLogger(__name__)

# Bump when the programs' code changes in a way the versions below do not capture.
PROGRAM_FORMAT = 1


def program_fingerprint(arch: ModelArch, config: RuntimeConfig) -> dict:
    """Everything that determines the compiled programs, and nothing machine-specific."""
    return {
        "format": PROGRAM_FORMAT,
        "arch": arch.digest_fields(),
        "shapes": config.shape_fields(),
        "torch": torch.__version__,
        "vllm_aot": vllm_aot.__version__,
    }


def program_digest(arch: ModelArch, config: RuntimeConfig) -> str:
    blob = json.dumps(program_fingerprint(arch, config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def default_programs_dir(arch: ModelArch, config: RuntimeConfig) -> Path:
    return paths.cache_root() / "programs" / program_digest(arch, config)


@dataclass
class LoadReport:
    """What start-up did, per program: loaded from disk or compiled, and how long it took."""

    compiled: dict[str, float] = field(default_factory=dict)
    loaded: dict[str, float] = field(default_factory=dict)
    weights_seconds: float = 0.0
    weights_bytes: int = 0

    def summary(self) -> str:
        return (
            f"{len(self.loaded)} programs loaded ({sum(self.loaded.values()):.2f} s), "
            f"{len(self.compiled)} compiled ({sum(self.compiled.values()):.1f} s), "
            f"weights {self.weights_bytes / 1e6:.0f} MB in {self.weights_seconds:.2f} s"
        )


def default_num_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def program_path(programs_dir: Path, key: ProgramKey) -> Path:
    return programs_dir / f"{key.name}.pt2"


def missing_programs(config: RuntimeConfig, programs_dir: Path) -> list[ProgramKey]:
    """Programs of `config` with no compiled package in `programs_dir`."""
    return [k for k in all_program_keys(config) if not program_path(programs_dir, k).is_file()]


def compile_missing_programs(
    arch: ModelArch,
    config: RuntimeConfig,
    programs_dir: Path,
    *,
    num_workers: int | None = None,
    show_progress: bool = True,
    on_compiled: Callable[[str, float], None] | None = None,
) -> dict[str, float]:
    """Compile every program `programs_dir` lacks; returns compile seconds per program name.

    `on_compiled(name, seconds)` is called as each program finishes (for logs without a bar).
    """
    missing = [(k, program_path(programs_dir, k)) for k in missing_programs(config, programs_dir)]
    if not missing:
        return {}
    from tqdm import tqdm

    compiled: dict[str, float] = {}
    bar = tqdm(total=len(missing), desc="compiling programs", disable=not show_progress)

    def on_done(key: ProgramKey, seconds: float) -> None:
        compiled[key.name] = seconds
        logger.info("compiled %s in %.1f s", key.name, seconds)
        if on_compiled is not None:
            on_compiled(key.name, seconds)
        bar.update()

    try:
        compile_programs(
            missing,
            arch,
            config,
            num_workers=num_workers or default_num_workers(),
            on_done=on_done,
        )
    finally:
        bar.close()
    return compiled


def load_programs(
    arch: ModelArch, config: RuntimeConfig, programs_dir: Path | None, report: LoadReport
) -> dict[ProgramKey, Program]:
    """Every program of `config`: eager modules, or compiled packages read from `programs_dir`."""
    keys = all_program_keys(config)
    if config.backend == "eager":
        return {key: eager_program(key, arch, config) for key in keys}
    assert programs_dir is not None, "the inductor backend loads programs from a directory"
    missing = [k.name for k in missing_programs(config, programs_dir)]
    if missing:
        raise FileNotFoundError(f"{programs_dir} lacks compiled programs: {', '.join(missing)}")
    programs = {}
    for key in keys:
        start = time.perf_counter()
        programs[key] = load_program(program_path(programs_dir, key))
        if key.name not in report.compiled:
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
    programs_dir: Path | None = None,
    num_workers: int | None = None,
    show_progress: bool = True,
) -> tuple[CompiledModel, LoadReport]:
    """Load weights and programs (compiling missing ones) into a ready CompiledModel."""
    arch = load_arch(model_dir)
    check_fits(arch, config)
    report = LoadReport()
    if config.backend == "inductor":
        programs_dir = programs_dir or default_programs_dir(arch, config)
        report.compiled = compile_missing_programs(
            arch, config, programs_dir, num_workers=num_workers, show_progress=show_progress
        )
    programs = load_programs(arch, config, programs_dir, report)
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
