"""Async scheduling: the runner's work on one thread of its own, in the order vLLM submits it.

With `--async-scheduling` vLLM's engine schedules step N+1 before it has step N's tokens: it
calls `execute_model(N+1)` and `sample_tokens(N+1)` and only then waits for step N's output
(`EngineCore.step_with_batch_queue`). A GPU overlaps by running the step on its stream while the
host goes on; our "device" is the CPU, so the step runs on a thread of its own while the
engine's thread turns step N's output into responses and schedules the next step
(`AsyncSteps`).

The step thread is the stream: first in first out, so the runner sees `execute_model` and
`sample_tokens` calls exactly in the synchronous order, and a step's decode rows read the token
the previous step sampled (the runner keeps it, `CachedRequest.output_token_ids`) without the
scheduler having it yet. K/V a step writes for a request aborted meanwhile land before any later
step runs, so blocks vLLM hands to another request are rewritten after, never before.

A step that raises fails its output's `get_output()`: the engine's thread sees the exception
where it would have in the synchronous loop (a per-request failure is already in the output).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput


class QueuedOutput(AsyncModelRunnerOutput):
    """A step's runner output, ready once the step thread has run it."""

    def __init__(self, future: Future[ModelRunnerOutput]) -> None:
        self._future = future

    def get_output(self) -> ModelRunnerOutput:
        return self._future.result()


class AsyncSteps:
    """The worker's `execute_model`/`sample_tokens` under async scheduling.

    `execute_model` queues the layers and returns None (vLLM then calls `sample_tokens`), or,
    for a step with nothing scheduled, the runner's empty output once the thread reaches it.
    `sample_tokens` queues the head and returns a `QueuedOutput`; when the layers already made
    the step's output (every request failed), that output is the step's.
    """

    def __init__(
        self,
        execute: Callable[[Any], ModelRunnerOutput | None],
        sample: Callable[[Any], ModelRunnerOutput],
    ) -> None:
        self._execute = execute
        self._sample = sample
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-aot-steps")
        self._executed: Future[ModelRunnerOutput | None] | None = None

    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        executed = self._thread.submit(self._execute, scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return executed.result()  # vLLM takes this as the step's output, no sample_tokens
        self._executed = executed
        return None

    def sample_tokens(self, grammar_output) -> QueuedOutput:
        executed, self._executed = self._executed, None
        assert executed is not None, "sample_tokens without execute_model"
        return QueuedOutput(self._thread.submit(self._sample_after, executed, grammar_output))

    def _sample_after(self, executed: Future, grammar_output) -> ModelRunnerOutput:
        output = executed.result()  # done: the thread ran it first
        return output if output is not None else self._sample(grammar_output)

    def native_id(self) -> int:
        """The step thread's id in the kernel (starting the thread if it has not started)."""
        return self.call(threading.get_native_id)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn` on the step thread, after the queued steps; its result. The torch profiler
        records the thread that starts it, so it starts and stops here."""
        return self._thread.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Wait for the queued steps, then stop the thread."""
        self._thread.shutdown(wait=True)
