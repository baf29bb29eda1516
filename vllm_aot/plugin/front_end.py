"""The front end yields the cores to the steps.

On a machine whose every core runs one of the model's compute threads, whatever else wakes up
(vLLM's API server detokenising and streaming a token, the engine's own scheduling and output
threads) takes a core from a thread in the middle of a parallel loop, and the loop's other
threads wait for it: a front end costing 2 ms of CPU a token cost one stream 2-3 ms of its step
(docs/benchmarks.md, "The front end below the steps"). Run at a lower priority (a higher nice
value), the front end instead takes the moments a core is idle: the step's serial host work, the
gaps between steps.

`VLLM_AOT_FRONT_END_NICE` (0-19; `vllm-aot serve` sets 19, plain vLLM leaves it unset, which is
0: nothing changes) is the nice value the front end's threads get:

- in the engine's process, under async scheduling (`plugin/async_steps.py`) with one rank (the
  worker in the engine's process), every Python thread but the step thread, once it has started:
  the engine's main thread and, since a thread starts at its parent's value, the input and output
  threads vLLM starts after the worker;
- in the API server's process (`plugin/vllm_serve.py`), every thread, once the engine's process
  has forked from it (a child forked earlier would start at that value, compute threads and all).

A priority only ever goes down here: a thread already nicer than asked keeps its value.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection
from pathlib import Path

logger = logging.getLogger(__name__)

NICE_ENV = "VLLM_AOT_FRONT_END_NICE"
MAX_NICE = 19
ENGINE_TITLE = "VLLM::Engine"  # the start of an engine process's name (vLLM's process title)


def front_end_nice(environ: dict[str, str] | None = None) -> int:
    """The nice value asked for the front end's threads; 0 when unset."""
    value = (os.environ if environ is None else environ).get(NICE_ENV, "").strip()
    if not value:
        return 0
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"{NICE_ENV}={value!r}: expected an integer from 0 to {MAX_NICE}")
    return nice


def lower_thread(native_id: int, nice: int) -> bool:
    """Thread `native_id` to at least `nice`; False when it has gone meanwhile."""
    try:
        if os.getpriority(os.PRIO_PROCESS, native_id) < nice:
            os.setpriority(os.PRIO_PROCESS, native_id, nice)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def lower_python_threads(nice: int, *, keep: Collection[int]) -> list[int]:
    """Every Python thread of this process but those in `keep` (native ids) to `nice`; the
    native ids lowered."""
    if nice <= 0:
        return []
    others = [t.native_id for t in threading.enumerate() if t.native_id not in (None, *keep)]
    return [tid for tid in others if lower_thread(tid, nice)]


def lower_process(nice: int) -> list[int]:
    """Every thread of this process to `nice`; their native ids."""
    return [tid for tid in _own_threads() if lower_thread(tid, nice)]


def lower_after_engine_forks(nice: int, *, poll_seconds: float = 0.2) -> threading.Thread | None:
    """A daemon thread that lowers this process (`lower_process`) once a child process named
    as vLLM's engine (`ENGINE_TITLE`) exists: the engine forks from this process, so lowering
    it earlier would lower the engine too. None when `nice` is 0."""
    if nice <= 0:
        return None

    def wait_then_lower() -> None:
        while not any(name.startswith(ENGINE_TITLE) for name in _child_names()):
            time.sleep(poll_seconds)
        logger.info("vllm-aot: the API server's threads run at nice %d (%s)", nice, NICE_ENV)
        lower_process(nice)

    thread = threading.Thread(target=wait_then_lower, name="vllm-aot-front-end", daemon=True)
    thread.start()
    return thread


def _own_threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _child_names() -> list[str]:
    names = []
    for tid in _own_threads():
        try:
            children = Path(f"/proc/self/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                continue
    return names
