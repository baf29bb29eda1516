"""Parallel compilation in child interpreters.

The parent writes one JSON job file per worker and runs `python -m vllm_aot.runtime.compile_worker
JOBFILE`; the child compiles its programs in order and prints `done NAME SECONDS` after each, which
the parent turns into progress. A failing child's stderr is raised in the parent.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from vllm_aot.models.config import ModelArch, RopeSpec
from vllm_aot.processes import parent_death_signal
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, ProgramKind


def _job_file(jobs: Sequence[tuple[ProgramKey, Path]], arch: ModelArch, config: RuntimeConfig):
    payload = {
        "arch": {**asdict(arch), "rope": asdict(arch.rope)},
        "config": config.to_dict(),
        "jobs": [
            {"kind": k.kind.value, "size": k.size, "context": k.context_tokens, "path": str(p)}
            for k, p in jobs
        ],
    }
    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", prefix="vllm-aot-jobs-", delete=False
    ) as handle:
        json.dump(payload, handle)
    return Path(handle.name)


def run_workers(
    jobs: Sequence[tuple[ProgramKey, Path]],
    arch: ModelArch,
    config: RuntimeConfig,
    *,
    num_workers: int,
    on_done: Callable[[ProgramKey, float], None],
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
                [sys.executable, "-m", "vllm_aot.runtime.compile_worker", str(job_file)],
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
    import torch

    from vllm_aot.runtime.backends import compile_program

    torch.set_num_threads(1)
    payload = json.loads(Path(job_file).read_text())
    arch = ModelArch(**{**payload["arch"], "rope": RopeSpec(**payload["arch"]["rope"])})
    config = RuntimeConfig.from_dict(payload["config"])
    for job in payload["jobs"]:
        key = ProgramKey(ProgramKind(job["kind"]), job["size"], job["context"])
        secs = compile_program(key, arch, config, Path(job["path"]))
        print(f"done {key.name} {secs:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
