"""The proxy's view of its replicas: health, load, routing, counters. Runs in the event loop.

Routing: the healthy replica with the fewest requests in flight; ties go round-robin. A replica
leaves the rotation (ejection) when a health check fails, when a request to it cannot connect, or
when the replica manager sees its process exit; a replica answering 5xx is checked at once, not
at the next round (an engine that died answers 500 to every request until it is ejected); a
passing health check re-admits it. A started replica's failing health checks are timed from the
first of the run (`failing_since`), so the manager can kill and restart one that stays up but
stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import aiohttp

from vllm_aot.plugin.server_guard import REPLICA_CHALLENGE_HEADER, REPLICA_PROOF_HEADER, is_proof
from vllm_aot.serve.metrics import CounterFamily

logger = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    """Live state of one replica (mutated only from the event loop)."""

    index: int
    url: str  # http://127.0.0.1:PORT
    is_healthy: bool = False
    is_started: bool = False  # passed its first /health since (re)start
    num_in_flight: int = 0
    num_requests: int = 0
    num_errors: int = 0
    num_ejections: int = 0
    last_problem: str | None = None
    failing_since: float | None = None  # monotonic time of the first failed check in a row
    is_retired: bool = False  # left down for good: no more checks, `last_problem` says why
    check_now: asyncio.Task | None = field(default=None, repr=False)  # `check_at_once`


@dataclass
class ReplicaPool:
    """All replicas behind the proxy, plus the proxy-wide retry counter."""

    replicas: list[ReplicaState]
    is_started: bool = False  # every replica passed /health once (start-up complete)
    num_retries: int = 0
    _next: int = field(default=0, repr=False)  # round-robin origin for ties

    @classmethod
    def from_urls(cls, urls: list[str]) -> ReplicaPool:
        return cls([ReplicaState(i, url) for i, url in enumerate(urls)])

    def choose(self, exclude: frozenset[int] = frozenset()) -> ReplicaState | None:
        """The least-loaded healthy replica not in `exclude`; ties round-robin; None if none."""
        candidates = [r for r in self.replicas if r.is_healthy and r.index not in exclude]
        if not candidates:
            return None
        fewest = min(r.num_in_flight for r in candidates)
        tied = [r for r in candidates if r.num_in_flight == fewest]
        # Start the scan after the last replica picked, so ties rotate.
        tied.sort(key=lambda r: (r.index - self._next) % len(self.replicas))
        chosen = tied[0]
        self._next = chosen.index + 1
        return chosen

    def eject(self, replica: ReplicaState, reason: str) -> None:
        replica.last_problem = reason
        if replica.is_healthy:
            replica.is_healthy = False
            replica.num_ejections += 1
            logger.warning("replica %d ejected: %s", replica.index, reason)

    def admit(self, replica: ReplicaState) -> None:
        replica.is_started = True
        replica.failing_since = None
        if not replica.is_healthy:
            replica.is_healthy = True
            replica.last_problem = None
            logger.info("replica %d admitted (%s)", replica.index, replica.url)

    def mark_restarting(self, index: int, reason: str) -> None:
        """The manager saw replica `index` exit: eject it until a new process is healthy."""
        replica = self.replicas[index]
        self.eject(replica, reason)
        replica.is_started = False
        replica.failing_since = None

    def retire(self, index: int, reason: str) -> None:
        """The manager gave replica `index` up: it stays out, with `reason` in the report."""
        replica = self.replicas[index]
        replica.is_retired, replica.last_problem = True, reason

    def record_failed_check(self, replica: ReplicaState, problem: str) -> None:
        """A health check failed: eject a started replica and start timing its failures (one
        still starting is expected to fail)."""
        if replica.is_retired:
            return  # a check that began before the manager gave it up
        if not replica.is_started:
            replica.last_problem = problem
            return
        self.eject(replica, problem)
        if replica.failing_since is None:
            replica.failing_since = time.monotonic()

    @property
    def is_serving(self) -> bool:
        return self.is_started and any(r.is_healthy for r in self.replicas)

    def health_report(self) -> dict:
        return {
            "status": "ok" if self.is_serving else "unavailable",
            "started": self.is_started,
            "replicas": [
                {
                    "replica": r.index,
                    "healthy": r.is_healthy,
                    "started": r.is_started,
                    "in_flight": r.num_in_flight,
                    "problem": r.last_problem,
                }
                for r in self.replicas
            ],
        }

    def counter_families(self) -> list[CounterFamily]:
        def per_replica(attribute: str) -> dict[str | None, float]:
            return {str(r.index): float(getattr(r, attribute)) for r in self.replicas}

        prefix = "vllm_aot_proxy_"
        return [
            CounterFamily(
                f"{prefix}requests_total",
                "counter",
                "Requests the proxy sent to each replica.",
                per_replica("num_requests"),
            ),
            CounterFamily(
                f"{prefix}errors_total",
                "counter",
                "Requests that failed at or after sending to each replica.",
                per_replica("num_errors"),
            ),
            CounterFamily(
                f"{prefix}retries_total",
                "counter",
                "Requests retried on another replica after a connection failure.",
                {None: float(self.num_retries)},
            ),
            CounterFamily(
                f"{prefix}ejections_total",
                "counter",
                "Times each replica was taken out of rotation.",
                per_replica("num_ejections"),
            ),
            CounterFamily(
                f"{prefix}in_flight",
                "gauge",
                "Requests in flight on each replica.",
                per_replica("num_in_flight"),
            ),
            CounterFamily(
                f"{prefix}replica_healthy",
                "gauge",
                "1 while a replica is in rotation.",
                {str(r.index): float(r.is_healthy) for r in self.replicas},
            ),
        ]


def failure(exc: BaseException) -> str:
    """An upstream error for `/health` and clients: its kind and cause, no replica address."""
    if isinstance(exc, aiohttp.ClientConnectorError):  # its text names the address
        errno = exc.os_error.errno
        return f"{type(exc).__name__} {os.strerror(errno) if errno else ''}".strip()
    return f"{type(exc).__name__} {exc}".strip()


async def check_replica(
    session: aiohttp.ClientSession,
    pool: ReplicaPool,
    replica: ReplicaState,
    timeout: float,
    replica_key: str | None = None,
) -> bool:
    """GET /health once; admit on 200 (with the replica key: 200 with the proof of the key,
    `plugin/server_guard.py`), eject otherwise. Returns whether it passed."""
    nonce = secrets.token_hex(16)
    headers = {REPLICA_CHALLENGE_HEADER: nonce} if replica_key else {}
    try:
        async with session.get(
            f"{replica.url}/health", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            proof = response.headers.get(REPLICA_PROOF_HEADER)
            if response.status == 200 and (not replica_key or is_proof(replica_key, nonce, proof)):
                pool.admit(replica)
                return True
            problem = f"/health answered {response.status}"
            if response.status == 200:
                problem += " without the replica key's proof (not this launch's replica)"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:  # OSError: EMFILE, say
        problem = f"/health failed: {failure(exc)}"
    pool.record_failed_check(replica, problem)
    return False


def check_at_once(
    session: aiohttp.ClientSession,
    pool: ReplicaPool,
    replica: ReplicaState,
    timeout: float,
    replica_key: str | None = None,
) -> None:
    """Check `replica`'s health now, not at the next round (one such check at a time)."""
    if replica.check_now is not None and not replica.check_now.done():
        return
    check = check_replica(session, pool, replica, timeout, replica_key)
    replica.check_now = asyncio.create_task(check)
    replica.check_now.add_done_callback(_log_failed_check)


def _log_failed_check(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("health check failed: %r", task.exception())


async def health_loop(
    session: aiohttp.ClientSession,
    pool: ReplicaPool,
    *,
    interval: float,
    timeout: float,
    replica_key: str | None = None,
) -> None:
    """Check every replica concurrently each `interval` seconds, forever (cancel to stop). An
    error in a round is logged (once while it repeats) and the next round goes on."""
    last_error = None
    while True:
        checked = [r for r in pool.replicas if not r.is_retired]
        try:
            await asyncio.gather(
                *(check_replica(session, pool, r, timeout, replica_key) for r in checked)
            )
            last_error = None
        except Exception as exc:
            if repr(exc) != last_error:
                logger.exception("health checks failed; they go on")
            last_error = repr(exc)
        await asyncio.sleep(interval)
