"""Load-aware reverse proxy in front of the replicas (aiohttp), on the public port.

Bodies stream both ways in chunks as they arrive; nothing is buffered whole (a request body's
first `REPLAY_BYTES` are kept, to send it again: see below). `/health` and `/metrics` are the
proxy's own (aggregated); every other path is forwarded to one replica with its headers. With
API keys every path but `/health` (and `/metrics` when public) needs one, checked here before
anything is forwarded; CORS preflights are answered here (`serve/auth.py`). Every request to a
replica carries the launch's replica key, which replicas require on every route
(`plugin/server_guard.py`). Client connections are capped and timed before aiohttp sees them
(`serve/connections.py`).

Failures: a request is retried once at most. One whose connection could not be opened (nothing
sent) is retried on another replica. One sent on a reused kept-alive connection that closed
before any byte of an answer came (`ServerDisconnectedError`, a reset: the replica had closed
it, as a restarted replica has; a new connection that does so is a replica failing, and is not
retried, so one request cannot take down two replicas) is sent again on a new connection
(`_fresh`: never a pooled one), when the body read so far fits `REPLAY_BYTES` (kept for that).
Any other failure is not retried. A replica that fails before answering gives the client 502
(504 on a timeout); one that fails mid-stream ends an event stream with an SSE error event (what
vLLM itself sends) and drops any other response's connection, so a client never mistakes a cut
body for a whole one. A client that disconnects cancels its handler, which closes the upstream
connection, so vLLM aborts the request and frees its slot.

Stopping (`stop_accepting`, `drain`, `stop`): the listening socket closes and kept-alive
connections close after their current response; requests in flight carry on until their replica
ends them or the caller's deadline passes; whatever is left is then cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from vllm_aot.plugin.server_guard import REPLICA_KEY_HEADER, CorsSettings
from vllm_aot.serve.auth import ApiKeys, authentication, cors_preflights
from vllm_aot.serve.connections import ConnectionGuard, ConnectionLimits, fitting_limits
from vllm_aot.serve.metrics import merge_expositions
from vllm_aot.serve.pool import ReplicaPool, ReplicaState, check_at_once, failure, health_loop

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
    )
)
REPLICA_HEADER = "X-Vllm-Aot-Replica"
# How long requests still in flight get to end once their replica is gone, and cancelled
# handlers to close their connections, when the proxy stops.
CANCEL_SECONDS = 1.0
REPLAY_BYTES = 1024 * 1024  # request bodies up to this are kept to send again (see above)


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024  # request bodies above this get 413
    connect_timeout: float = 5.0  # seconds to open a connection to a replica
    read_timeout: float = 600.0  # seconds a replica may stay silent (before or between chunks)
    health_interval: float = 2.0  # seconds between health-check rounds
    health_timeout: float = 2.0
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none: the proxy checks no key
    is_metrics_public: bool = False  # /metrics without a key even when keys are required
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # client connections
    cors: CorsSettings = field(default_factory=CorsSettings)  # vLLM's CORS flags
    replica_key: str | None = field(default=None, repr=False)  # what replicas require

    @property
    def replica_headers(self) -> dict[str, str]:
        """Headers every request to a replica carries."""
        return {REPLICA_KEY_HEADER: self.replica_key} if self.replica_key else {}

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "connect_timeout", "read_timeout", "health_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"proxy {name} must be positive, got {getattr(self, name)}")


class _BodyTooLarge(Exception):
    pass


class _NoAnswer(Exception):
    """A reused connection closed before any byte of an answer: safe to send again."""


async def _note_reuse(session, context, params) -> None:
    if isinstance(context.trace_request_ctx, dict):  # `_send`'s record of its attempt
        context.trace_request_ctx["reused"] = True


class _RequestBody:
    """The client's body as an async iterator of chunks, counted against the limit. Each
    iteration starts over: the chunks kept (while they fit `REPLAY_BYTES`), then the rest."""

    def __init__(self, content: aiohttp.StreamReader, limit: int) -> None:
        self._content, self._limit = content, limit
        self.num_bytes = 0
        self.is_too_large = False
        self._kept: list[bytes] | None = []  # None once the body outgrew REPLAY_BYTES

    @property
    def can_resend(self) -> bool:
        return self._kept is not None and not self.is_too_large

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in list(self._kept or ()):
            yield chunk
        async for chunk in self._content.iter_any():
            self.num_bytes += len(chunk)
            if self.num_bytes > self._limit:
                self.is_too_large = True
                raise _BodyTooLarge
            if self._kept is not None:
                if self.num_bytes <= REPLAY_BYTES:
                    self._kept.append(chunk)
                else:
                    self._kept = None
            yield chunk


def _error(status: int, message: str, *, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": web.Response(status=status).reason}}
    return web.json_response(body, status=status, headers=headers)


def _sse_error(message: str) -> bytes:
    event = {"error": {"message": message, "type": "BadGateway", "code": 502}}
    return f"data: {json.dumps(event)}\n\n".encode()


class Proxy:
    """Serve `pool` on `config.host:port` until `stop()`; health checks run in the background."""

    def __init__(self, pool: ReplicaPool, config: ProxyConfig) -> None:
        self.pool, self.config = pool, config
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.guard = ConnectionGuard(fitting_limits(config.limits))
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # a new connection each request
        self._health_task: asyncio.Task | None = None
        self._in_flight: set[asyncio.Task] = set()  # forward() handlers running now
        self.is_stopping = False

    async def start(self) -> None:
        reuse_trace = aiohttp.TraceConfig()
        reuse_trace.on_connection_reuseconn.append(_note_reuse)
        self._session, self._fresh = (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=force_close),
                trace_configs=[reuse_trace],
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.config.connect_timeout, sock_read=None
                ),
            )
            for force_close in (False, True)
        )
        public = [self.handle_health]
        if self.config.is_metrics_public:
            public.append(self.handle_metrics)
        keys = self.config.api_keys
        # first: a request stops its header watchdog; then preflights, answered here
        middlewares = [self.guard.middleware(), cors_preflights(self.config.cors)]
        if keys.is_required:
            middlewares.append(authentication(keys, public))
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        # handler_cancellation: a client that goes away cancels its handler at once, even while
        # the replica is silent (prefill), instead of at the next write. shutdown_timeout: stop()
        # comes after drain(), so whatever is still running then is cancelled promptly.
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=CANCEL_SECONDS,
            keepalive_timeout=self.guard.limits.keepalive_timeout,
        )
        await self._runner.setup()
        # Clients connect through the guard (serve/connections.py), then reach aiohttp.
        self._listener = await asyncio.get_running_loop().create_server(
            self.guard.wrap(self._runner.server), self.config.host, self.config.port, backlog=128
        )
        self._health_task = asyncio.create_task(
            health_loop(
                self._session,
                self.pool,
                interval=self.config.health_interval,
                timeout=self.config.health_timeout,
                replica_key=self.config.replica_key,
            )
        )

    async def stop_accepting(self) -> None:
        """Close the listening socket and idle kept-alive connections; new requests that still
        arrive on a busy connection get 503. Health checks stop. Requests in flight go on."""
        self.is_stopping = True
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._listener:
            self._listener.close()
        if self._runner and self._runner.server:
            self._runner.server.pre_shutdown()

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` s for the requests in flight to end; returns how many remain."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout)
        return len(self._in_flight)

    async def stop(self) -> None:
        """Stop accepting, cancel what is still in flight (its upstream connections close, so
        the replicas abort those requests), close everything. Safe to call twice."""
        await self.stop_accepting()
        for task in self._in_flight:
            task.cancel()
        await self.drain(timeout=CANCEL_SECONDS)
        if self._runner:
            await self._runner.cleanup()
            self._runner = None
        for session in (self._session, self._fresh):
            if session:
                await session.close()

    async def handle_health(self, request: web.Request) -> web.Response:
        report = self.pool.health_report()
        return web.json_response(report, status=200 if self.pool.is_serving else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        async def scrape(replica: ReplicaState) -> str | None:
            try:
                async with self._session.get(
                    f"{replica.url}/metrics",
                    headers=self.config.replica_headers,
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout * 5),
                ) as response:
                    return await response.text() if response.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None  # a down replica has no series; replica_healthy says so

        admitted = [r for r in self.pool.replicas if r.is_healthy]  # proved the replica key
        texts = await asyncio.gather(*(scrape(r) for r in admitted))
        merged = merge_expositions(
            {str(r.index): t for r, t in zip(admitted, texts, strict=True) if t}
        )
        families = [*self.pool.counter_families(), *self.guard.counter_families()]
        own = "".join(f.render() for f in families)
        return web.Response(text=merged + own, content_type="text/plain", charset="utf-8")

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Send `request` to the least-loaded healthy replica and stream its answer back."""
        if self.is_stopping:
            return _error(503, "the server is shutting down", headers={"Connection": "close"})
        task = asyncio.current_task()
        self._in_flight.add(task)
        try:
            return await self._forward(request)
        finally:
            self._in_flight.discard(task)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error(413, f"request body of {request.content_length} bytes exceeds {limit}")
        body = _RequestBody(request.content, limit)
        exclude: frozenset[int] = frozenset()
        is_retry = False
        while True:
            replica = self.pool.choose(exclude)
            if replica is None:
                return _error(503, "no healthy replica", headers={"Retry-After": "1"})
            replica.num_in_flight += 1
            replica.num_requests += 1
            try:
                return await self._send(request, replica, body, may_resend=not is_retry)
            except aiohttp.ClientConnectorError as exc:
                # The connection never opened, so nothing was sent: safe to try elsewhere.
                replica.num_errors += 1
                self.pool.eject(replica, f"connect failed: {failure(exc)}")
                if is_retry or not body.can_resend:
                    return _error(502, f"replica {replica.index} unreachable: {failure(exc)}")
                exclude = frozenset({replica.index})
            except _NoAnswer as exc:
                replica.num_errors += 1
                logger.info(
                    "replica %d closed the connection unanswered (%s); resending",
                    replica.index,
                    exc,
                )
            finally:
                replica.num_in_flight -= 1
            is_retry = True
            self.pool.num_retries += 1

    async def _send(
        self, request: web.Request, replica: ReplicaState, body: _RequestBody, *, may_resend: bool
    ) -> web.StreamResponse:
        """Send `request` to `replica` and stream the answer back; raises
        ClientConnectorError (nothing sent), or _NoAnswer when `may_resend` and a reused
        connection closed before any byte of an answer, with the body still kept."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update(self.config.replica_headers)
        if request.remote:
            headers["X-Forwarded-For"] = request.remote
        attempt = {"reused": False}
        try:
            session = self._session if may_resend else self._fresh
            upstream = await session.request(
                request.method,
                f"{replica.url}{request.rel_url}",
                headers=headers,
                trace_request_ctx=attempt,
                data=body if request.body_exists else None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.config.connect_timeout,
                    sock_read=self.config.read_timeout,
                ),
            )
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientError, TimeoutError, _BodyTooLarge) as exc:
            is_unanswered = isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)
            may_resend = may_resend and attempt["reused"] and not self.is_stopping
            if is_unanswered and may_resend and body.can_resend:
                raise _NoAnswer(f"{type(exc).__name__} {exc}") from exc
            if body.is_too_large:
                return _error(413, f"request body exceeds {self.config.max_body_bytes} bytes")
            replica.num_errors += 1
            message = f"replica {replica.index} failed: {type(exc).__name__} {exc}"
            if self.is_stopping:  # the replica was told to stop before it answered
                return _error(503, f"{message} (the server is shutting down)")
            return _error(504 if isinstance(exc, TimeoutError) else 502, message)
        if upstream.status >= 500:  # an engine that died answers 500 until it is ejected
            config = self.config
            check_at_once(
                self._session, self.pool, replica, config.health_timeout, config.replica_key
            )
        try:
            response = await self._stream_back(request, replica, upstream)
        except BaseException:  # the client went away (cancelled) or writing to it failed
            upstream.close()  # drops the replica connection: vLLM aborts the request
            raise
        upstream.release()  # a whole body read: the connection goes back to the pool
        return response

    async def _stream_back(
        self, request: web.Request, replica: ReplicaState, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.add(name, value)
        response.headers[REPLICA_HEADER] = str(replica.index)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            replica.num_errors += 1
            message = f"replica {replica.index} failed mid-response: {type(exc).__name__} {exc}"
            if self.is_stopping:
                message += " (the server is shutting down)"
            logger.warning(message)
            if upstream.content_type != "text/event-stream":
                # No in-band way to say "cut short": drop the connection instead of ending it.
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write(_sse_error(message))
        await response.write_eof()
        return response
