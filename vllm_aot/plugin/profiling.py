"""Torch profiler traces of our programs, for vLLM's `/start_profile` and `/stop_profile`.

Enabled the way vLLM enables it: `--profiler-config '{"profiler": "torch",
"torch_profiler_dir": "/abs/dir"}'`; without it vLLM serves neither endpoint and
`AotWorker.profile` refuses. vLLM's `TorchProfilerWrapper` runs a session (per-request
`delay_iterations`/`max_iterations`, warm-up schedules, record_shapes/memory/flops as configured,
the summary table it prints and writes next to the trace); we give it a trace writer that names
the file after our worker, writes it staged then renamed (gzip unless `torch_profiler_use_gzip`
is false) and logs where it went. Python stacks stay off whatever the config says: our steps are a
few program calls, and stack capture would swamp the host-side phases a trace is meant to time.

While a session records, `CompiledModel.spans` is on: each program call is a range named after its
program (`decode_b4_c256`, `greedy_r4`, ...) inside ranges for the step's phases.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from torch.profiler import profile
from vllm.config import ProfilerConfig
from vllm.config.utils import replace
from vllm.profiler.wrapper import TorchProfilerWrapper

from vllm_aot.files import staged_path

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it


class TraceWriter:
    """`on_trace_ready`: the session as a Chrome/Perfetto trace `{name}.{ns}.pt.trace.json[.gz]`
    (torch's and vLLM's naming)."""

    def __init__(self, directory: str, *, use_gzip: bool, name: str) -> None:
        self.directory = Path(directory)
        self.use_gzip = use_gzip
        self.name = name

    def __call__(self, session: profile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        file_name = f"{self.name}.{time.time_ns()}.pt.trace.json"
        if self.use_gzip:
            file_name += ".gz"  # export_chrome_trace compresses by this suffix
        path = self.directory / file_name
        with staged_path(path) as staging:
            session.export_chrome_trace(str(staging))
        logger.info("vllm-aot: torch profiler trace written to %s", path)


class WorkerProfiler:
    """One worker's profiling sessions: `start(name)`, `step()` per engine step, `stop()`."""

    def __init__(self, config: ProfilerConfig, *, rank: int) -> None:
        assert config.profiler == "torch", f"profiler {config.profiler!r} (only 'torch')"
        config = replace(config, torch_profiler_with_stack=False)
        self.writer = TraceWriter(
            config.torch_profiler_dir, use_gzip=config.torch_profiler_use_gzip, name="vllm_aot"
        )
        self.session = TorchProfilerWrapper(
            config,
            worker_name=self.writer.name,
            local_rank=rank,
            activities=tuple(config.torch_profiler_activities or ("CPU",)),
            on_trace_ready=self.writer,
        )
        logger.info(
            "vllm-aot: torch profiler ready (CPU, no Python stacks); traces go to %s",
            config.torch_profiler_dir,
        )

    @property
    def is_recording(self) -> bool:
        return self.session.should_annotate

    def start(self, name: str, *, delay_iterations: int | None, max_iterations: int | None) -> None:
        """Start a session (vLLM ignores a start while one is active, and so do we)."""
        if not self.session.is_running:
            self.writer.name = name
            self.session.set_output_name(name)
        self.session.start(delay_iterations=delay_iterations, max_iterations=max_iterations)

    def step(self) -> None:
        self.session.step()

    def stop(self) -> None:
        """Stop the session; the trace is written before this returns (the last one, with a
        warm-up schedule: a schedule writes each active window as it ends)."""
        self.session.stop()

    def shutdown(self) -> None:
        self.session.shutdown()
