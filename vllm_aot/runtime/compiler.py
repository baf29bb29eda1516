"""Ahead-of-time compilation: `torch.export` with static shapes, then AOTInductor, in parallel
child interpreters.

A program is exported with only the KV pools' block count symbolic and compiled into a
self-contained `.pt2` package (weights are inputs, never constants, so one package per bucket does
not repeat them). Several programs compile in `python -m vllm_aot.runtime.compiler JOBFILE`
children: the parent writes one JSON job file per worker; the child compiles its programs in
order and prints `done NAME SECONDS` after each, which the parent turns into progress. A failing
child's stderr is raised in the parent. A full disk is one error wherever it happens (in a child,
in `on_done` on a worker's thread, in this process): `OSError(ENOSPC)`, which the compile cache
reports as its `CacheDiskFullError`.
"""

from __future__ import annotations

import errno
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
_DISK_FULL = "disk-full"  # a child's line `disk-full NAME`: its device filled compiling NAME


def _is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a full device (an OSError, or a C++
    compiler's output that says so)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _disk_full(what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device while compiling {what}")


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
            try:
                seconds[key] = compile_program(key, arch, config, path)
            except Exception as exc:
                if _is_disk_full(exc) and getattr(exc, "errno", None) != errno.ENOSPC:
                    raise _disk_full(key.name) from exc
                raise
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
                "group": k.group,
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
    # Largest programs first, dealt round-robin, so workers finish at about the same time.
    ordered = sorted(jobs, key=lambda job: -job[0].size)
    groups = [ordered[i::num_workers] for i in range(num_workers) if ordered[i::num_workers]]
    workers = _Workers(jobs, arch, config, on_done)
    threads = [threading.Thread(target=workers.run, args=(group,)) for group in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return workers.outcome()


class _Workers:
    """Child compilers, each read by a thread of this process, and what they report. The first
    error (a child's full disk, an `on_done` that raises) stops every child: what they built is
    not committed, and that error is the one raised."""

    def __init__(self, jobs, arch: ModelArch, config: RuntimeConfig, on_done: OnDone) -> None:
        self.by_name = {key.name: key for key, _ in jobs}
        self.arch, self.config, self.on_done = arch, config, on_done
        self.seconds: dict[ProgramKey, float] = {}
        self.errors: list[str] = []  # the end of each failed child's stderr
        self.disk_full: list[str] = []  # programs a child found no space for
        self.raised: list[BaseException] = []  # errors in this process (on_done, a job file)
        self.procs: list[subprocess.Popen] = []
        self.stopped = False
        self.lock = threading.Lock()

    def run(self, group: Sequence[tuple[ProgramKey, Path]]) -> None:
        job_file = None
        try:
            job_file = _job_file(group, self.arch, self.config)
            self._compile(job_file)
        except BaseException as exc:
            with self.lock:
                self._stop(exc)
        finally:
            if job_file is not None:
                job_file.unlink(missing_ok=True)

    def outcome(self) -> dict[ProgramKey, float]:
        if self.raised:
            raise self.raised[0]
        if self.disk_full:
            failed = RuntimeError("compiling programs failed:\n" + "\n".join(self.errors))
            raise _disk_full(", ".join(self.disk_full)) from failed
        if self.errors:
            raise RuntimeError("compiling programs failed:\n" + "\n".join(self.errors))
        return self.seconds

    def _compile(self, job_file: Path) -> None:
        with self.lock:
            if self.stopped:
                return
            proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_aot.runtime.compiler", str(job_file)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # Killed with the thread that started it: a killed parent leaves no compiler
                # running, and its half-built entries stay invisible.
                preexec_fn=parent_death_signal(signal.SIGKILL),
            )
            self.procs.append(proc)
        stderr_lines: list[str] = []
        drain = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr))
        drain.start()
        for line in proc.stdout:
            with self.lock:
                self._report(line.split())
        drain.join()
        with self.lock:
            if proc.wait() != 0 and not self.stopped:
                self.errors.append("".join(stderr_lines[-40:]))

    def _report(self, fields: list[str]) -> None:
        if fields[:1] == [_DISK_FULL] and len(fields) == 2:
            self.disk_full.append(fields[1])
            self._stop()
        elif fields[:1] == ["done"] and len(fields) == 3 and not self.stopped:
            key, seconds = self.by_name[fields[1]], float(fields[2])
            self.seconds[key] = seconds
            try:
                self.on_done(key, seconds)
            except BaseException as exc:
                self._stop(exc)

    def _stop(self, error: BaseException | None = None) -> None:
        """Kill every child still compiling (the lock held)."""
        if error is not None:
            self.raised.append(error)
        self.stopped = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


def main(job_file: str) -> None:
    torch.set_num_threads(1)
    payload = json.loads(Path(job_file).read_text())
    arch = ModelArch(**{**payload["arch"], "rope": RopeSpec(**payload["arch"]["rope"])})
    config = RuntimeConfig.from_dict(payload["config"])
    for job in payload["jobs"]:
        key = ProgramKey(
            ProgramKind(job["kind"]),
            job["size"],
            job["context"],
            job["drafts"],
            job["window"],
            job["group"],
        )
        try:
            secs = compile_program(key, arch, config, Path(job["path"]))
        except Exception as exc:
            if _is_disk_full(exc):
                print(f"{_DISK_FULL} {key.name}", flush=True)
            raise
        print(f"done {key.name} {secs:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
