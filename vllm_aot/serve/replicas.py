"""Replica processes: start pinned to their cores, wait for health, restart, stop. No leftovers.

Every replica is vLLM's OpenAI server on a loopback port, started in our process group (no new
session: a Ctrl-C or a test's teardown reaches it too) with its CPU affinity set to its core
group before exec. Affinity is inherited by vLLM's engine process, where `AotWorker.init_device`
sets torch's threads to the affinity size; `OMP_NUM_THREADS` says the same to OpenMP. Each
replica also gets `PR_SET_PDEATHSIG` = SIGTERM, so even a SIGKILLed manager takes it down.

Restarts: a replica that exits after start-up is ejected at once and restarted on the same port
after a backoff (1, 2, 4 … up to 30 s); the failure count resets once it passes /health again.
A replica that stays up but fails every health check for `hang_timeout` s (stopped, deadlocked,
its engine gone), or a restarted one not healthy within `start_timeout` s, is SIGKILLed with its
descendants and goes the same way. After `max_restarts` failures in a row it stays down. A
replica that exits during the first start-up is not restarted: start-up fails fast and stops
every replica.

Nothing stops the watching but every replica being down for good: an error while looking at
processes (EMFILE, psutil's AccessDenied under a `/proc` mounted `hidepid`, anything) is logged
and the next look goes on; a restart that cannot spawn is tried again after the next backoff.

Nothing here blocks the event loop: signals are sent at once, and waiting for processes to exit
(psutil's polling) runs in a worker thread, so the proxy keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from vllm_aot.placement import pin_process
from vllm_aot.processes import parent_death_signal
from vllm_aot.serve.pool import ReplicaPool

logger = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL when serving stops
ORPHAN_GRACE_SECONDS = 2.0  # SIGTERM -> SIGKILL for what a dead replica left behind


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
    start_timeout: float = 900.0  # s from a (re)start to its first passing /health
    hang_timeout: float = 30.0  # s a started replica may fail /health in a row before a kill

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        for name in ("initial_backoff", "max_backoff", "start_timeout", "hang_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def backoff(self, num_failures: int) -> float:
        return min(self.initial_backoff * 2 ** (num_failures - 1), self.max_backoff)


class ReplicaExitedError(RuntimeError):
    """A replica exited during start-up."""


def _pin_and_tie(cores: tuple[int, ...]) -> Callable[[], None]:
    tie = parent_death_signal(signal.SIGTERM)

    def preexec() -> None:
        pin_process(cores)
        tie()

    return preexec


def _send(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        # psutil refuses a pid reused by another process; one we may not signal is left be.
        with contextlib.suppress(psutil.Error, OSError):
            process.send_signal(signum)


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # there, but not ours to read


def _stop_trees(trees: list[list[psutil.Process]], *, grace: float) -> list[int]:
    """SIGTERM every tree's root at once (a vLLM server stops its own engine) and wait for them;
    then SIGTERM the descendants that outlived their root; SIGKILL whatever is left `grace` s
    after the start (descendants get at most `ORPHAN_GRACE_SECONDS` of it); reap. Returns the
    indices of the trees that needed a SIGKILL. Blocks: call it from a worker thread."""
    deadline = time.monotonic() + grace
    roots = [tree[0] for tree in trees if tree]
    _send(roots, signal.SIGTERM)
    psutil.wait_procs(roots, timeout=grace)
    descendants = [p for tree in trees for p in tree[1:] if _is_alive(p)]
    _send(descendants, signal.SIGTERM)
    left = max(0.0, min(ORPHAN_GRACE_SECONDS, deadline - time.monotonic()))
    psutil.wait_procs(descendants, timeout=left)
    alive = {(i, p) for i, tree in enumerate(trees) for p in tree if _is_alive(p)}
    _send([p for _, p in alive], signal.SIGKILL)
    psutil.wait_procs([p for _, p in alive], timeout=5)
    return sorted({i for i, _ in alive})


class ReplicaManager:
    """Owns the replica processes; tells `pool` when one exits or hangs. Drive it from one
    event loop; none of its coroutines blocks it."""

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
        self._spawned_at = [0.0] * len(specs)
        self._kill_reasons: list[str | None] = [None] * len(specs)  # why we SIGKILLed it
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
        self._spawned_at[index] = time.monotonic()
        self._kill_reasons[index] = None
        _say(f"replica {index} (pid {process.pid}) on cores {list(spec.cores)}, {spec.url}")

    def start_all(self) -> None:
        for index in range(len(self.specs)):
            self._spawn(index)

    async def wait_started(self) -> None:
        """Return once every replica passed /health (the proxy's checks); fail fast on an exit,
        TimeoutError after the policy's `start_timeout`."""
        timeout = self.policy.start_timeout
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
            try:
                root = psutil.Process(process.pid)
                known = {p.pid for p in self._trees[index]}
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            except (psutil.Error, OSError) as exc:  # hidepid, EMFILE: the next look may see
                logger.warning("could not list replica %d's processes: %r", index, exc)
                continue
            self._trees[index] += [p for p in children if p.pid not in known]

    async def watch(self) -> None:
        """Notice exits and hangs, eject, restart on schedule; returns when every replica is
        down for good. Cancel it to stop watching. An error in a look is logged (once while it
        repeats) and the next look goes on."""
        tick, last_error = 0, None
        while True:
            try:
                await self._look(tick)
                last_error = None
            except Exception as exc:
                if repr(exc) != last_error:
                    logger.exception("watching the replicas failed; it goes on")
                last_error = repr(exc)
            if all(
                p is None and t is None
                for p, t in zip(self._processes, self._restart_at, strict=True)
            ):
                return
            tick += 1
            await asyncio.sleep(0.2)

    async def _look(self, tick: int) -> None:
        """One look at every replica: restart those due, handle exits and hangs."""
        now = time.monotonic()
        for index, process in enumerate(self._processes):
            replica = self.pool.replicas[index]
            if process is None:
                if self._restart_at[index] is not None and now >= self._restart_at[index]:
                    self._restart(index)
            elif process.poll() is not None:
                await self._on_exit(index, process.returncode)
            elif (hang := self._hang(index, now)) is not None:
                self._kill(index, hang)
            elif replica.is_started and replica.failing_since is None:
                self._failures[index] = 0
        if tick % 5 == 4:
            self._snapshot_trees()

    def _restart(self, index: int) -> None:
        self.num_restarts += 1
        try:
            self._spawn(index)
        except OSError as exc:  # EMFILE, ENOMEM: try again after the next backoff
            delay = self.policy.backoff(max(1, self._failures[index]))
            self._restart_at[index] = time.monotonic() + delay
            _say(f"replica {index} could not start ({exc}); trying again in {delay:.0f} s")
            return
        self._restart_at[index] = None

    def _hang(self, index: int, now: float) -> str | None:
        """Why replica `index` (alive) counts as hung, or None: failing /health for
        `hang_timeout` s since it started, or not started `start_timeout` s after a restart."""
        replica = self.pool.replicas[index]
        if self._kill_reasons[index] is not None:
            return None  # already killed; its exit is noticed on the next tick
        if replica.is_started:
            since, limit = replica.failing_since, self.policy.hang_timeout
            what, detail = "failed every health check", f" ({replica.last_problem})"
        else:
            since, limit = self._spawned_at[index], self.policy.start_timeout
            what, detail = "did not pass a health check since its start", ""
        if since is None or now - since < limit:
            return None
        return f"{what} for {now - since:.0f} s{detail}"

    def _kill(self, index: int, reason: str) -> None:
        """SIGKILL replica `index` and its descendants (signals only; the exit is handled by
        `watch` like any other)."""
        self._snapshot_trees()
        self._kill_reasons[index] = reason
        _say(f"replica {index} (pid {self._processes[index].pid}) {reason}; killing it")
        _send(self._trees[index], signal.SIGKILL)

    async def _on_exit(self, index: int, code: int) -> None:
        killed = self._kill_reasons[index]
        reason = f"killed after it {killed}" if killed else f"process exited with code {code}"
        self.pool.mark_restarting(index, reason)
        self._processes[index] = None
        self._failures[index] += 1
        if self._failures[index] > self.policy.max_restarts:
            message = f"{reason}; {self._failures[index] - 1} restarts failed, leaving it down"
            self.pool.retire(index, message)
        else:
            delay = self.policy.backoff(self._failures[index])
            self._restart_at[index] = time.monotonic() + delay
            message = f"{reason}; restarting in {delay:.0f} s"
        _say(f"replica {index} {message}")
        # Orphans of the dead server (its engine core), in a thread: psutil's waits block.
        tree = self._trees[index]
        await asyncio.to_thread(_stop_trees, [tree], grace=ORPHAN_GRACE_SECONDS)

    async def stop_all(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every replica at once, SIGKILL what is left `grace` s later (descendants
        included), reap. Waits in a worker thread; safe to call twice."""
        self._snapshot_trees()
        self._restart_at = [None] * len(self.specs)
        processes = [p for p in self._processes if p is not None]
        killed = await asyncio.to_thread(_stop_and_reap, self._trees, processes, grace)
        self._processes = [None] * len(self.specs)
        if killed:
            _say(f"replicas {killed} (or their engines) outlived SIGTERM by {grace:.0f} s: killed")


def _stop_and_reap(
    trees: list[list[psutil.Process]], processes: list[subprocess.Popen], grace: float
) -> list[int]:
    killed = _stop_trees(trees, grace=grace)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(1)  # reap, so no zombie outlives us
    return killed


def _say(message: str) -> None:
    print(f"vllm-aot serve: {message}", file=sys.stderr, flush=True)
