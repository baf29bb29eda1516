"""The proxy's guard on client connections, so that idle or slow clients cannot take the open
files serving needs (its connections to the replicas, their health checks, their restarts).

- At most `max_connections` client connections at once, and `max_connections_per_client` from
  one client address. A new connection over either limit takes the place of the one idle longest
  (no request in progress: still sending its header, or kept alive between requests) of that
  client, or of anyone for the total, which is closed; so a client sending a request gets in
  however many connections sit idle, and a kept-alive client between two requests is not cut off
  for connections that have sat idle longer. Where every one is busy with a request, the new one is
  answered `503` naming the limit and closed; it never reaches aiohttp. The total is also capped
  to what the open-file limit allows (`fitting_limits`: each proxied request holds two
  descriptors, the client's and the replica's), and `serve` raises its soft open-file limit to
  the hard one first (`raise_open_file_limit`).
- A new connection must send a whole request header within `header_timeout` s, or it is closed
  (a watchdog per connection; data trickling in does not extend it).
- Between requests a kept-alive connection may stay idle `keepalive_timeout` s (aiohttp's
  setting, which also closes one whose next request header is still incomplete by then).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from vllm_aot.serve.metrics import CounterFamily

logger = logging.getLogger(__name__)

RESERVED_FILES = 64  # descriptors kept for everything but client connections
REFUSED_LINGER_SECONDS = 1.0  # how long a refused connection may take to read its 503
MAX_LINGERING = 256  # refused connections past this many lingering are closed at once


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024  # client connections at once (all clients)
    max_connections_per_client: int = 256  # client connections at once from one address
    header_timeout: float = 10.0  # s a new connection has to send a whole request header
    keepalive_timeout: float = 15.0  # s a kept-alive connection may stay idle between requests

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"proxy {name} must be 1 or more, got {getattr(self, name)}")
        for name in ("header_timeout", "keepalive_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"proxy {name} must be positive, got {getattr(self, name)}")


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def fitting_limits(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with the total capped to what the open-file soft limit holds (a proxied request
    holds a client's descriptor and a replica's), with a warning where it is lowered."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits
    fits = max(1, (soft - RESERVED_FILES) // 2)
    if limits.max_connections <= fits:
        return limits
    logger.warning(
        "at most %d client connections (the open-file limit is %d), not %d",
        fits,
        soft,
        limits.max_connections,
    )
    return replace(
        limits,
        max_connections=fits,
        max_connections_per_client=min(fits, limits.max_connections_per_client),
    )


def refusal(message: str) -> bytes:
    """A whole HTTP/1.1 `503` answer that names why, then closes."""
    body = json.dumps({"error": {"message": message, "type": "Service Unavailable"}}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """Counts client connections by address and enforces `limits` (see the module docstring).

    `wrap(factory)` is the protocol factory to listen with (around aiohttp's server);
    `middleware()` must be the application's first: it marks a connection busy while its
    request is handled (so not evicted) and stops its header watchdog."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.num_refused = 0
        self.num_evicted = 0
        self.num_timed_out = 0
        self.num_lingering = 0
        self._per_client: collections.Counter[str] = collections.Counter()
        self._open: dict[_GuardedProtocol, None] = {}  # idle longest first
        self._by_handler: dict[Any, _GuardedProtocol] = {}

    @property
    def num_open(self) -> int:
        return len(self._open)

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(factory(), self)

    def middleware(self) -> Callable:
        """The aiohttp middleware that stops a connection's header watchdog."""
        from aiohttp import web

        @web.middleware
        async def request_received(request, handler: Callable[[Any], Awaitable]):
            connection = self._by_handler.get(request.protocol)
            if connection is None:
                return await handler(request)
            connection.header_received()
            connection.num_requests += 1
            try:
                return await handler(request)
            finally:
                connection.num_requests -= 1
                if connection.num_requests == 0:
                    self._went_idle(connection)

        return request_received

    def counter_families(self) -> list[CounterFamily]:
        prefix = "vllm_aot_proxy_connections"
        return [
            CounterFamily(
                f"{prefix}_open", "gauge", "Client connections open.", {None: self.num_open}
            ),
            CounterFamily(
                f"{prefix}_refused_total",
                "counter",
                "Client connections answered 503 at a connection limit (all busy).",
                {None: self.num_refused},
            ),
            CounterFamily(
                f"{prefix}_evicted_total",
                "counter",
                "Idle client connections closed for a new one at a connection limit.",
                {None: self.num_evicted},
            ),
            CounterFamily(
                f"{prefix}_header_timeouts_total",
                "counter",
                "Client connections closed without a whole request header in time.",
                {None: self.num_timed_out},
            ),
        ]

    def make_room(self, client: str) -> str | None:
        """Room for a new connection from `client`: where it is at a limit, the connection idle
        longest of that client (its own limit) or of anyone (the total) is closed. Returns
        the problem where no connection was idle."""
        limits = self.limits
        if self._per_client[client] >= limits.max_connections_per_client and not self._evict(
            client
        ):
            return (
                f"too many connections from {client}: at most "
                f"{limits.max_connections_per_client} a client, all busy "
                "(--proxy-max-connections-per-client)"
            )
        if self.num_open >= limits.max_connections and not self._evict(None):
            return (
                f"too many connections: the server holds at most {limits.max_connections}, "
                "all busy (--proxy-max-connections)"
            )
        return None

    def _evict(self, client: str | None) -> bool:
        for connection in self._open:
            if connection.num_requests == 0 and client in (None, connection.client):
                self.num_evicted += 1
                connection.close_now()
                return True
        return False

    def _went_idle(self, connection: _GuardedProtocol) -> None:
        """`connection` finished its requests: it is now the one idle the shortest time."""
        if self._open.pop(connection, False) is not False:
            self._open[connection] = None

    def opened(self, connection: _GuardedProtocol) -> None:
        self._open[connection] = None
        self._per_client[connection.client] += 1
        self._by_handler[connection.inner] = connection

    def closed(self, connection: _GuardedProtocol) -> None:
        if self._open.pop(connection, False) is not False:
            self._per_client[connection.client] -= 1
            if self._per_client[connection.client] <= 0:
                del self._per_client[connection.client]
        self._by_handler.pop(connection.inner, None)


class _GuardedProtocol(asyncio.Protocol):
    """One client connection: refused over a limit, else handed to aiohttp's protocol (`inner`)
    under the header watchdog."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner, self.guard = inner, guard
        self.client = "?"
        self.is_refused = False
        self._is_lingering = False
        self.num_requests = 0  # in progress (the middleware counts)
        self.transport: asyncio.Transport | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        problem = self.guard.make_room(self.client)
        if problem is not None:
            self._refuse(problem)
            return
        self.guard.opened(self)
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self.guard.limits.header_timeout, self._header_expired)
        self.inner.connection_made(transport)

    def _refuse(self, problem: str) -> None:
        self.is_refused = True
        self.guard.num_refused += 1
        transport = self.transport
        if self.guard.num_lingering >= MAX_LINGERING:
            transport.abort()
            return
        self.guard.num_lingering += 1
        self._is_lingering = True
        transport.write(refusal(problem))
        if transport.can_write_eof():
            transport.write_eof()
        # The client reads the 503 and closes; one that does not is cut off soon.
        asyncio.get_running_loop().call_later(REFUSED_LINGER_SECONDS, transport.abort)

    def header_received(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _header_expired(self) -> None:
        self._watchdog = None
        self.guard.num_timed_out += 1
        logger.debug("closing a connection from %s: no request header", self.client)
        self.close_now()

    def close_now(self) -> None:
        """Close at once (counted out now; aiohttp hears of it when the transport says)."""
        self.header_received()
        self.guard.closed(self)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.is_refused:  # a refused connection's request is read and dropped
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.is_refused:
            return None  # close
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self.is_refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.is_refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.is_refused:
            self.guard.num_lingering -= self._is_lingering
            return
        self.header_received()  # stops the watchdog
        self.guard.closed(self)
        self.inner.connection_lost(exc)
