"""Ahead-of-time compilation: `torch.export` with static shapes, then AOTInductor, in parallel
child interpreters.

A program is exported with only the KV pools' block count symbolic and compiled into a
self-contained `.pt2` package (weights are inputs, never constants, so one package per bucket does
not repeat them). Several programs compile in `python -m vllm_aot.runtime.compiler JOBFILE`
children: the parent writes one JSON job file per worker; the child compiles its programs in
order and prints `done NAME SECONDS` after each, which the parent turns into progress. A failing
child's stderr is raised in the parent.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from vllm_aot.files import staged_path
from vllm_aot.models.config import ModelArch, RopeSpec
from vllm_aot.processes import parent_death_signal
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import (
    ProgramKey,
    ProgramKind,
    build_module,
    dynamic_shapes,
    example_inputs,
)

# Inductor emits parallel loops only when it compiles for more than one thread, and by default
# it reads the compiling process's thread count (1 in our compile workers) and may hardcode it.
# Prefill and head programs are compiled as for CODEGEN_THREADS threads with `#pragma omp
# parallel` left to the runtime's OpenMP pool, so one program serves any core count and its cache
# key names no machine. Decode layer programs are compiled serial: what Inductor generates there
# (norms, rotary, residuals, SwiGLU over a few rows of the hidden size) is microseconds of work,
# while a parallel region costs a fork and a barrier, ~9 a layer, and stalls whenever another
# process (the server's front end) holds one of the cores. Their linears and attention are our
# kernels, parallel on their own.
# Verify layer programs (speculative decoding: a decode batch of k + 1 tokens a row) likewise
# (docs/benchmarks.md#serial-decode-programs).
SERIAL_KINDS = (ProgramKind.DECODE, ProgramKind.VERIFY)
CODEGEN_THREADS = 8
PARALLEL_SETTINGS = {"cpp.threads": CODEGEN_THREADS, "cpp.dynamic_threads": True}
SERIAL_SETTINGS = {"cpp.threads": 1, "cpp.dynamic_threads": False}


def inductor_settings(kind: ProgramKind) -> dict[str, object]:
    """The Inductor settings a program of `kind` is compiled with (part of its cache key)."""
    return SERIAL_SETTINGS if kind in SERIAL_KINDS else PARALLEL_SETTINGS


OnDone = Callable[[ProgramKey, float], None]


def compile_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig, path: Path) -> float:
    """Export and AOT-compile one program into `path`; returns seconds spent.

    The package is written under a staging name and renamed, so a reader never sees half of it.
    """
    start = time.perf_counter()
    module = build_module(key, arch, config)
    inputs = example_inputs(key, arch, config)
    with torch.no_grad(), torch._inductor.config.patch(inductor_settings(key.kind)):
        exported = torch.export.export(
            module, inputs, dynamic_shapes=dynamic_shapes(key, inputs), strict=False
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged_path(path) as staging:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(staging))
    return time.perf_counter() - start


def compile_programs(
    jobs: Iterable[tuple[ProgramKey, Path]],
    arch: ModelArch,
    config: RuntimeConfig,
    *,
    num_workers: int,
    on_done: OnDone = lambda key, seconds: None,
) -> dict[ProgramKey, float]:
    """Compile several programs in `num_workers` child processes; returns seconds per program.

    Each compile is single-threaded (g++ dominates), so workers scale with cores. Workers are
    fresh interpreters, never forks of a process that holds OpenMP threads, and they need no
    `__main__` guard from the caller.
    """
    jobs = list(jobs)
    if num_workers <= 1 or len(jobs) <= 1:
        seconds = {}
        for key, path in jobs:
            seconds[key] = compile_program(key, arch, config, path)
            on_done(key, seconds[key])
        return seconds
    return _run_workers(jobs, arch, config, num_workers=num_workers, on_done=on_done)


def _job_file(jobs: Sequence[tuple[ProgramKey, Path]], arch: ModelArch, config: RuntimeConfig):
    payload = {
        "arch": {**asdict(arch), "rope": asdict(arch.rope)},
        "config": config.to_dict(),
        "jobs": [
            {
                "kind": k.kind.value,
                "size": k.size,
                "context": k.context_tokens,
                "drafts": k.num_drafts,
                "window": k.window,
                "path": str(p),
            }
            for k, p in jobs
        ],
    }
    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", prefix="vllm-aot-jobs-", delete=False
    ) as handle:
        json.dump(payload, handle)
    return Path(handle.name)


def _run_workers(
    jobs: Sequence[tuple[ProgramKey, Path]],
    arch: ModelArch,
    config: RuntimeConfig,
    *,
    num_workers: int,
    on_done: OnDone,
) -> dict[ProgramKey, float]:
    by_name = {key.name: key for key, _ in jobs}
    # Largest programs first, dealt round-robin, so workers finish at about the same time.
    ordered = sorted(jobs, key=lambda job: -job[0].size)
    groups = [ordered[i::num_workers] for i in range(num_workers) if ordered[i::num_workers]]
    seconds: dict[ProgramKey, float] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def run(group: Sequence[tuple[ProgramKey, Path]]) -> None:
        job_file = _job_file(group, arch, config)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_aot.runtime.compiler", str(job_file)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # Killed with the thread that started it: a killed parent leaves no compiler
                # running, and its half-built entries stay invisible.
                preexec_fn=parent_death_signal(signal.SIGKILL),
            )
            stderr_lines: list[str] = []
            drain = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr))
            drain.start()
            for line in proc.stdout:
                if line.startswith("done "):
                    _, name, secs = line.split()
                    with lock:
                        seconds[by_name[name]] = float(secs)
                        on_done(by_name[name], float(secs))
            drain.join()
            if proc.wait() != 0:
                with lock:
                    errors.append("".join(stderr_lines[-40:]))
        finally:
            job_file.unlink(missing_ok=True)

    threads = [threading.Thread(target=run, args=(group,)) for group in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("compiling programs failed:\n" + "\n".join(errors))
    return seconds


def main(job_file: str) -> None:
    torch.set_num_threads(1)
    payload = json.loads(Path(job_file).read_text())
    arch = ModelArch(**{**payload["arch"], "rope": RopeSpec(**payload["arch"]["rope"])})
    config = RuntimeConfig.from_dict(payload["config"])
    for job in payload["jobs"]:
        key = ProgramKey(
            ProgramKind(job["kind"]), job["size"], job["context"], job["drafts"], job["window"]
        )
        secs = compile_program(key, arch, config, Path(job["path"]))
        print(f"done {key.name} {secs:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
