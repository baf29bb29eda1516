"""Replica processes: start pinned to their cores, wait for health, restart, stop. No leftovers.

Every replica is vLLM's OpenAI server on a loopback port, started in our process group (no new
session: a Ctrl-C or a test's teardown reaches it too) with its CPU affinity set to its core
group before exec. Affinity is inherited by vLLM's engine process, where `AotWorker.init_device`
sets torch's threads to the affinity size; `OMP_NUM_THREADS` says the same to OpenMP. Each
replica also gets `PR_SET_PDEATHSIG` = SIGTERM, so even a SIGKILLed manager takes it down.

Restarts: a replica that exits after start-up is ejected at once and restarted on the same port
after a backoff (1, 2, 4 … up to 30 s); the failure count resets once it passes /health again.
After `max_restarts` failures in a row it stays down. A replica that exits during start-up is
not restarted: start-up fails fast and stops every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from vllm_aot.processes import parent_death_signal
from vllm_aot.serve.pool import ReplicaPool

logger = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    port: int
    cores: tuple[int, ...]
    command: tuple[str, ...]
    env: dict[str, str]  # the child's whole environment

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # consecutive failures before a replica is left down; 0 = never
    initial_backoff: float = 1.0
    max_backoff: float = 30.0

    def backoff(self, num_failures: int) -> float:
        return min(self.initial_backoff * 2 ** (num_failures - 1), self.max_backoff)


class ReplicaExitedError(RuntimeError):
    """A replica exited during start-up."""


def thread_env(base: dict[str, str], num_cores: int) -> dict[str, str]:
    """`base` plus the thread settings for a process pinned to `num_cores` cores."""
    return {
        **base,
        "OMP_NUM_THREADS": str(num_cores),
        # vLLM's own OpenMP binding is for its multiprocess executor; ours pins by affinity.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def _pin_and_tie(cores: tuple[int, ...]) -> Callable[[], None]:
    tie = parent_death_signal(signal.SIGTERM)

    def preexec() -> None:
        os.sched_setaffinity(0, cores)
        tie()

    return preexec


def _signal_all(processes: list[psutil.Process], *, grace: float) -> None:
    """SIGTERM `processes`, wait up to `grace` s, SIGKILL the rest and reap them."""
    alive = [p for p in processes if p.is_running()]
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def _stop_trees(trees: list[list[psutil.Process]], *, grace: float) -> None:
    """Stop each tree's root (a vLLM server stops its own engine on SIGTERM), then whatever
    descendants outlived it."""
    _signal_all([tree[0] for tree in trees if tree], grace=grace)
    _signal_all([p for tree in trees for p in tree[1:]], grace=2.0)


class ReplicaManager:
    """Owns the replica processes; tells `pool` when one exits. Drive it from one event loop."""

    def __init__(
        self,
        specs: list[ReplicaSpec],
        pool: ReplicaPool,
        *,
        policy: RestartPolicy,
        log_dir: Path | None = None,
    ) -> None:
        self.specs, self.pool, self.policy, self.log_dir = specs, pool, policy, log_dir
        self._processes: list[subprocess.Popen | None] = [None] * len(specs)
        self._trees: list[list[psutil.Process]] = [[] for _ in specs]
        self._failures = [0] * len(specs)
        self._restart_at: list[float | None] = [None] * len(specs)
        self.num_restarts = 0

    def _spawn(self, index: int) -> None:
        spec = self.specs[index]
        output = None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"replica-{index}.log", "ab")  # noqa: SIM115
        try:
            process = subprocess.Popen(
                spec.command,
                env=spec.env,
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                preexec_fn=_pin_and_tie(spec.cores),  # only syscalls after fork, see above
            )
        finally:
            if output:
                output.close()  # the child holds its own descriptor
        self._processes[index] = process
        self._trees[index] = [psutil.Process(process.pid)]
        print(
            f"vllm-aot serve: replica {index} (pid {process.pid}) on cores "
            f"{list(spec.cores)}, {spec.url}",
            file=sys.stderr,
            flush=True,
        )

    def start_all(self) -> None:
        for index in range(len(self.specs)):
            self._spawn(index)

    async def wait_started(self, timeout: float) -> None:
        """Return once every replica passed /health (the proxy's checks); fail fast on an exit."""
        deadline = time.monotonic() + timeout
        while not all(r.is_started for r in self.pool.replicas):
            for index, process in enumerate(self._processes):
                if process is not None and process.poll() is not None:
                    raise ReplicaExitedError(
                        f"replica {index} exited with code {process.returncode} during start-up"
                    )
            if time.monotonic() > deadline:
                waiting = [r.index for r in self.pool.replicas if not r.is_started]
                raise TimeoutError(f"replicas {waiting} not healthy after {timeout:.0f} s")
            self._snapshot_trees()
            await asyncio.sleep(0.2)
        self._snapshot_trees()
        self.pool.is_started = True

    def _snapshot_trees(self) -> None:
        """Remember each replica's descendants: after it dies they are orphans we must find."""
        for index, process in enumerate(self._processes):
            if process is None or process.poll() is not None:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(process.pid)
                known = {p.pid for p in self._trees[index]}
                children = root.children(recursive=True)
                self._trees[index] += [p for p in children if p.pid not in known]

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop` is set: notice exits, eject, restart on schedule. Returns early (with
        `stop` unset) when every replica is down for good."""
        tick = 0
        while not stop.is_set():
            now = time.monotonic()
            for index, process in enumerate(self._processes):
                if process is None:
                    if self._restart_at[index] is not None and now >= self._restart_at[index]:
                        self._restart_at[index] = None
                        self.num_restarts += 1
                        self._spawn(index)
                elif process.poll() is not None:
                    self._on_exit(index, process.returncode, now)
                elif self.pool.replicas[index].is_started:
                    self._failures[index] = 0
            if all(
                p is None and t is None
                for p, t in zip(self._processes, self._restart_at, strict=True)
            ):
                return
            tick += 1
            if tick % 5 == 0:
                self._snapshot_trees()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.2)

    def _on_exit(self, index: int, code: int, now: float) -> None:
        reason = f"process exited with code {code}"
        self.pool.mark_restarting(index, reason)
        _stop_trees([self._trees[index]], grace=2.0)  # orphans of the dead server (engine core)
        self._processes[index] = None
        self._failures[index] += 1
        if self._failures[index] > self.policy.max_restarts:
            message = f"{reason}; {self._failures[index] - 1} restarts failed, leaving it down"
            self.pool.replicas[index].last_problem = message
        else:
            delay = self.policy.backoff(self._failures[index])
            self._restart_at[index] = now + delay
            message = f"{reason}; restarting in {delay:.0f} s"
        print(f"vllm-aot serve: replica {index} {message}", file=sys.stderr, flush=True)

    def stop_all(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every replica, wait up to `grace` s in all, SIGKILL what is left (their
        descendants included). Safe to call twice; blocks."""
        self._snapshot_trees()
        self._restart_at = [None] * len(self.specs)
        _stop_trees(self._trees, grace=grace)
        for process in self._processes:
            if process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(1)  # reap, so no zombie outlives us
        self._processes = [None] * len(self.specs)
