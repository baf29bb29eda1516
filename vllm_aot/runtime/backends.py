"""Backends turn a program into a callable.

- `eager`: the program's module itself; no compile (tests, debugging).
- `inductor`: `torch.export` with static shapes (only the KV pool size is symbolic), then
  AOTInductor into a self-contained `.pt2` package: our equivalent of a Neuron NEFF. Weights are
  program inputs, never constants, so a package holds code only and one package per bucket does not
  repeat the weights. Packages load in milliseconds without re-tracing or recompiling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch

from vllm_aot.kernels import load_used
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, build_module, dynamic_shapes, example_inputs


class Program(Protocol):
    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def eager_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> Program:
    module = build_module(key, arch, config)
    return torch.no_grad()(module)


# Inductor emits parallel loops only when it compiles for more than one thread, and by default
# it reads the compiling process's thread count (1 in our compile workers) and may hardcode it.
# Programs are compiled as for CODEGEN_THREADS threads with `#pragma omp parallel` left to the
# runtime's OpenMP pool, so one program serves any core count and its cache key names no machine.
CODEGEN_THREADS = 8
INDUCTOR_SETTINGS = {"cpp.threads": CODEGEN_THREADS, "cpp.dynamic_threads": True}


def compile_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig, path: Path) -> float:
    """Export and AOT-compile one program into `path`; returns seconds spent.

    The package is written under a staging name and renamed, so a reader never sees half of it.
    """
    start = time.perf_counter()
    module = build_module(key, arch, config)
    inputs = example_inputs(key, arch, config)
    with torch.no_grad(), torch._inductor.config.patch(INDUCTOR_SETTINGS):
        exported = torch.export.export(
            module, inputs, dynamic_shapes=dynamic_shapes(key, inputs), strict=False
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(staging))
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
    return time.perf_counter() - start


def load_program(path: Path, config: RuntimeConfig) -> Program:
    """A compiled package; the kernels it calls by name are loaded into the process first."""
    load_used(config.torch_dtype)
    return torch._inductor.aoti_load_package(str(path))


def compile_programs(
    jobs: Iterable[tuple[ProgramKey, Path]],
    arch: ModelArch,
    config: RuntimeConfig,
    *,
    num_workers: int,
    on_done: Callable[[ProgramKey, float], None] = lambda key, seconds: None,
) -> dict[ProgramKey, float]:
    """Compile several programs in `num_workers` child processes; returns seconds per program.

    Each compile is single-threaded (g++ dominates), so workers scale with cores. Workers are
    fresh interpreters (`python -m vllm_aot.runtime.compile_worker`), never forks of a process that
    holds OpenMP threads, and they need no `__main__` guard from the caller.
    """
    jobs = list(jobs)
    if num_workers <= 1 or len(jobs) <= 1:
        seconds = {}
        for key, path in jobs:
            seconds[key] = compile_program(key, arch, config, path)
            on_done(key, seconds[key])
        return seconds
    from vllm_aot.runtime.compile_worker import run_workers

    return run_workers(jobs, arch, config, num_workers=num_workers, on_done=on_done)
