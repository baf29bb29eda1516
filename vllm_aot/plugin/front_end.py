"""The front end yields the cores to the steps.

On a machine whose every core runs one of the model's compute threads, whatever else wakes up
(vLLM's API server detokenising and streaming a token, the engine's own scheduling and output
threads) takes a core from a thread in the middle of a parallel loop, and the loop's other
threads wait for it (docs/benchmarks.md#front-end-priority). Run at a lower priority (a higher nice
value), the front end instead takes the moments a core is idle: the step's serial host work, the
gaps between steps.

`VLLM_AOT_FRONT_END_NICE` (0-19, or `idle`; `vllm-aot serve` sets `idle`, plain vLLM leaves it
unset, which is 0: nothing changes) is the nice value the front end's threads get, or for
`idle` nice 19 and Linux's `SCHED_IDLE` policy: below every nice value, such a thread never
preempts a compute thread and runs where a core would otherwise idle (with OpenMP's waiting
threads spinning briefly, as `vllm-aot serve`'s `GOMP_SPINCOUNT` has them; with libgomp's
default spin the cores never idle and the front end starves). At nice 19 a front-end thread
still takes a compute thread's core for a scheduler slice now and then, which `SCHED_IDLE`
does not (docs/benchmarks.md#front-end-priority):

- in the engine's process, under async scheduling (`plugin/async_steps.py`) with one rank (the
  worker in the engine's process), every Python thread but the step thread, once it has started:
  the engine's main thread and, since a thread starts at its parent's value, the input and output
  threads vLLM starts after the worker;
- in the API server's process (`plugin/vllm_serve.py`), every thread, once the engine's process
  has forked from it (a child forked earlier would start at that value, compute threads and all).

A priority only ever goes down here: a thread already nicer than asked keeps its value.

Cores of its own: which, if any, `placement.split_front_end` decides (vLLM's
`VLLM_CPU_NUM_OF_RESERVED_CPU`; by default, under `vllm-aot serve`, one core from
`placement.MIN_CORES_TO_RESERVE` on). The platform decides once, where the steps have a thread of
their own (async scheduling, one rank), and the decision travels to the engine in its options:
there the same threads that are lowered are also pinned to the front end's cores
(`placement.pin_threads`), and the step thread, with the OpenMP team it starts, to the rest, one
compute thread a core; the API server pins itself there once the engine has forked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection
from pathlib import Path

from vllm_aot.placement import RESERVED_ENV, pin_threads

logger = logging.getLogger(__name__)

NICE_ENV = "VLLM_AOT_FRONT_END_NICE"
MAX_NICE = 19
IDLE = MAX_NICE + 1  # `idle`: nice 19 and the SCHED_IDLE policy
ENGINE_TITLE = "VLLM::Engine"  # the start of an engine process's name (vLLM's process title)


def front_end_nice(environ: dict[str, str] | None = None) -> int:
    """The nice value asked for the front end's threads (`IDLE` for `idle`); 0 when unset."""
    value = (os.environ if environ is None else environ).get(NICE_ENV, "").strip()
    if not value:
        return 0
    if value == "idle":
        return IDLE
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"{NICE_ENV}={value!r}: expected an integer from 0 to {MAX_NICE}, or idle")
    return nice


def python_threads(*, keep: Collection[int]) -> list[int]:
    """Native ids of this process's Python threads but those in `keep`."""
    return [t.native_id for t in threading.enumerate() if t.native_id not in (None, *keep)]


def lower_thread(native_id: int, nice: int) -> bool:
    """Thread `native_id` to at least `nice` (`IDLE`: nice 19 and SCHED_IDLE); False when it
    has gone meanwhile."""
    try:
        if os.getpriority(os.PRIO_PROCESS, native_id) < min(nice, MAX_NICE):
            os.setpriority(os.PRIO_PROCESS, native_id, min(nice, MAX_NICE))
        if nice == IDLE and os.sched_getscheduler(native_id) != os.SCHED_IDLE:
            os.sched_setscheduler(native_id, os.SCHED_IDLE, os.sched_param(0))
    except (ProcessLookupError, PermissionError):
        return False
    return True


def lower_python_threads(nice: int, *, keep: Collection[int]) -> list[int]:
    """Every Python thread of this process but those in `keep` (native ids) to `nice`; the
    native ids lowered."""
    if nice <= 0:
        return []
    return [tid for tid in python_threads(keep=keep) if lower_thread(tid, nice)]


def lower_process(nice: int) -> list[int]:
    """Every thread of this process to `nice`; their native ids."""
    return [tid for tid in _own_threads() if lower_thread(tid, nice)]


def plan_front_end(cores: Collection[int], *, is_async: bool) -> None:
    """Record what this process's configuration chose (the platform does, in the API server's
    process, before the engine starts) for `lower_after_engine_forks`: the front end's cores,
    and whether steps run on a thread of their own. Under synchronous scheduling (pooling,
    speculative decoding) the API server feeds the engine prompts while a step computes, and at
    SCHED_IDLE it waited for the step's end to hand over the rest: there `idle` lowers it to
    nice 19 only."""
    global _reserved, _is_async
    _reserved, _is_async = tuple(cores), is_async


_reserved: tuple[int, ...] = ()
_is_async = True


def lower_after_engine_forks(nice: int, *, poll_seconds: float = 0.2) -> threading.Thread | None:
    """A daemon thread that, once a child process named as vLLM's engine (`ENGINE_TITLE`)
    exists, lowers this process (`lower_process`) and pins it to the front end's cores when the
    configuration reserved some (`plan_front_end`): the engine forks from this process, so
    doing either earlier would do it to the engine too. None when neither can happen (no
    lowering asked and no `VLLM_CPU_NUM_OF_RESERVED_CPU`: `placement.split_front_end` reserves
    nothing)."""
    if nice <= 0 and not os.environ.get(RESERVED_ENV, "").strip():
        return None

    def wait_then_lower() -> None:
        while not any(name.startswith(ENGINE_TITLE) for name in _child_names()):
            time.sleep(poll_seconds)
        level = nice if _is_async else min(nice, MAX_NICE)
        if level > 0:
            name = "SCHED_IDLE" if level == IDLE else f"nice {level}"
            logger.info("vllm-aot: the API server's threads run at %s (%s)", name, NICE_ENV)
            lower_process(level)
        if _reserved:
            logger.info("vllm-aot: the API server runs on cores %s", list(_reserved))
            pin_threads(_own_threads(), _reserved)

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
