"""No client can stop `serve`: connection caps, header and idle timeouts, the open-file limit, a
replica watcher and health loop that go on through any error; and a request sent on a stale
pooled connection to a replica is sent again."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import httpx
import psutil
import pytest
from aiohttp import web

from tests.helpers import children_of, is_gone, wait_until
from tests.test_serve_lifecycle import ROOT
from tests.test_serve_proxy import proxied_with_proxy
from vllm_aot.serve import pool as pool_module
from vllm_aot.serve import replicas as replicas_module
from vllm_aot.serve.auth import ApiKeys
from vllm_aot.serve.connections import (
    RESERVED_FILES,
    ConnectionLimits,
    fitting_limits,
    raise_open_file_limit,
)
from vllm_aot.serve.pool import ReplicaPool, health_loop
from vllm_aot.serve.proxy import Proxy, ProxyConfig
from vllm_aot.serve.replicas import ReplicaManager, ReplicaSpec, RestartPolicy
from vllm_aot.testing import free_port, wait_healthy

HALF_HEADER = b"POST /v1/echo HTTP/1.1\r\nHost: proxy\r\nContent-Le"
KEY = "the-key"


@contextlib.contextmanager
def proxy_in_thread(**config):
    """A proxy over two fake replicas, served from an event loop on a thread: (url, proxy)."""
    loop = asyncio.new_event_loop()
    ready: dict = {}
    stop = asyncio.Event()

    async def serve() -> None:
        async with proxied_with_proxy(**config) as (_, _replicas, _pool, proxy):
            ready["proxy"] = proxy
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        proxy = wait_until(lambda: ready.get("proxy"), 30, "the proxy started")
        yield f"http://127.0.0.1:{proxy.config.port}", proxy
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def half_header_sockets(port: int, count: int, source: str) -> list[socket.socket]:
    """`count` connections from address `source` that each send half a request header."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(HALF_HEADER)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def read_until_closed(sock: socket.socket, received: dict[socket.socket, bytes]) -> bool:
    """Read what `sock` has; whether the proxy closed it."""
    try:
        while data := sock.recv(65536):
            received[sock] = received.get(sock, b"") + data
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


def keyed_request(url: str, source: str = "127.0.0.1") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source)) as client:
        return client.post(f"{url}/v1/echo", content=b"hello", headers=headers, timeout=10)


@pytest.mark.unit
def test_half_header_connections_cannot_keep_a_keyed_request_out_and_are_closed_in_time():
    limits = ConnectionLimits(
        max_connections=100, max_connections_per_client=50, header_timeout=1.5
    )
    with proxy_in_thread(limits=limits, api_keys=ApiKeys.of([KEY])) as (url, proxy):
        opened = time.monotonic()
        sockets = half_header_sockets(proxy.config.port, 200, "127.0.0.2")
        guard = proxy.guard
        wait_until(lambda: guard.num_evicted >= 150, 10, "the oldest 150 closed for newer ones")
        assert guard.num_open <= 50
        for source in ("127.0.0.2", "127.0.0.1"):  # the same client, and another one
            response = keyed_request(url, source)
            assert response.status_code == 200
            assert response.content == b"hello"
        wait_until(
            lambda: all([read_until_closed(s, {}) for s in sockets]),
            limits.header_timeout + 5,
            "every half-header connection closed",
        )
        assert time.monotonic() - opened < limits.header_timeout + 5
        assert guard.num_evicted + guard.num_timed_out == 200
        assert guard.num_refused == 0
        assert keyed_request(url).status_code == 200  # and after
        for sock in sockets:
            sock.close()
        wait_until(lambda: guard.num_open == 0, 10, "no connection counted")


@pytest.mark.unit
def test_over_the_total_an_idle_connection_gives_way_and_busy_ones_get_503_naming_the_limit():
    limits = ConnectionLimits(max_connections=2, header_timeout=30)

    def stream(url: str, started: threading.Event, done: threading.Event) -> None:
        with httpx.stream("POST", f"{url}/v1/stream", params={"n": "100"}, timeout=30) as response:
            for _ in response.iter_lines():
                started.set()
                if done.is_set():
                    return

    with proxy_in_thread(limits=limits) as (url, proxy):
        done = threading.Event()
        first, second = threading.Event(), threading.Event()
        threading.Thread(target=stream, args=(url, first, done), daemon=True).start()
        first.wait(10)
        (idle,) = half_header_sockets(proxy.config.port, 1, "127.0.0.2")
        wait_until(lambda: proxy.guard.num_open == 2, 10, "a stream and an idle connection")
        threading.Thread(target=stream, args=(url, second, done), daemon=True).start()
        assert second.wait(10)  # it took the idle connection's place
        wait_until(lambda: read_until_closed(idle, {}), 10, "the idle connection closed")
        response = httpx.post(f"{url}/v1/echo", content=b"x", timeout=10)
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "at most 2, all busy (--proxy-max-connections)" in message
        done.set()
        wait_until(lambda: proxy.guard.num_open == 0, 10, "the streams ended")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "vllm_aot_proxy_connections_refused_total 1\n" in metrics
        assert "vllm_aot_proxy_connections_evicted_total 1\n" in metrics
        assert httpx.post(f"{url}/v1/echo", content=b"x", timeout=10).status_code == 200


@pytest.mark.unit
def test_a_request_outlasts_the_header_timeout_and_then_idles_out_after_the_keepalive_one():
    limits = ConnectionLimits(header_timeout=0.3, keepalive_timeout=0.5)
    with proxy_in_thread(limits=limits) as (url, proxy), httpx.Client(timeout=10) as client:
        response = client.post(f"{url}/v1/stream", params={"n": "8"})  # 0.8 s
        assert response.status_code == 200
        assert response.text.endswith("data: [DONE]\n\n")
        assert proxy.guard.num_open == 1
        assert proxy.guard.num_timed_out == 0
        wait_until(lambda: proxy.guard.num_open == 0, 10, "the idle connection closed")


@contextlib.contextmanager
def lowered_open_file_limit(soft: int):
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, saved[1]))
    try:
        yield saved[1]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, saved)


@pytest.mark.unit
def test_the_soft_open_file_limit_is_raised_to_the_hard_one_and_caps_connections():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 400:
        pytest.skip(f"hard open-file limit {hard}")
    with lowered_open_file_limit(300):
        limits = fitting_limits(ConnectionLimits(max_connections=1000))
        assert limits.max_connections == (300 - RESERVED_FILES) // 2
        assert limits.max_connections_per_client == limits.max_connections
        assert raise_open_file_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard


@pytest.mark.unit
def test_the_health_loop_goes_on_after_an_error(monkeypatch):
    calls = []

    async def flaky_check(session, pool, replica, timeout, replica_key=None):
        calls.append(replica.index)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        pool.admit(replica)
        return True

    async def main():
        pool = ReplicaPool.from_urls(["http://127.0.0.1:1"])
        loop = asyncio.create_task(health_loop(None, pool, interval=0.01, timeout=1))
        try:
            for _ in range(500):
                if pool.replicas[0].is_healthy or loop.done():
                    break
                await asyncio.sleep(0.01)
            assert not loop.done()
            assert pool.replicas[0].is_healthy
        finally:
            loop.cancel()

    monkeypatch.setattr(pool_module, "check_replica", flaky_check)
    asyncio.run(main())


@pytest.mark.unit
def test_the_replica_watcher_goes_on_through_emfile_access_denied_and_a_failed_spawn(
    monkeypatch,
):
    sleeper = (sys.executable, "-c", "import time; time.sleep(60)")
    cores = tuple(sorted(os.sched_getaffinity(0)))
    spec = ReplicaSpec(0, 1, cores, sleeper, dict(os.environ))
    pool = ReplicaPool.from_urls([spec.url])
    policy = RestartPolicy(initial_backoff=0.1, max_backoff=0.1)
    manager = ReplicaManager([spec], pool, policy=policy)
    errors = iter(
        [OSError(errno.EMFILE, "Too many open files"), psutil.AccessDenied(), OSError(errno.EMFILE)]
    )
    raised = []

    def children(self, recursive=False):
        error = next(errors, None)
        if error is None:
            return []
        raised.append(error)
        raise error

    real_popen = replicas_module.subprocess.Popen
    spawns = []

    def popen_failing_once(*args, **kwargs):
        spawns.append(args)
        if len(spawns) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_popen(*args, **kwargs)

    async def main():
        manager.start_all()
        watching = asyncio.create_task(manager.watch())
        try:
            while len(raised) < 3 and not watching.done():
                await asyncio.sleep(0.05)
            assert not watching.done()
            monkeypatch.setattr(replicas_module.subprocess, "Popen", popen_failing_once)
            manager._processes[0].kill()  # restarts: the first spawn fails, the next one runs
            while manager._processes[0] is None or len(spawns) < 2:
                assert not watching.done()
                await asyncio.sleep(0.05)
            assert manager._processes[0].poll() is None
        finally:
            watching.cancel()
            await manager.stop_all(grace=2)

    monkeypatch.setattr(psutil.Process, "children", children)
    asyncio.run(asyncio.wait_for(main(), 60))


class ClosingReplica:
    """A replica that answers the first request on each connection (an echo) and closes the
    connection unanswered when another comes on it, as a replica does for a request sent on a
    kept-alive connection it had closed (restarted, or its idle timeout)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.num_dropped = 0
        self.bodies: list[bytes] = []
        self._counts: dict[int, int] = {}

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        key = id(request.protocol)
        self._counts[key] = self._counts.get(key, 0) + 1
        if self._counts[key] > 1:
            self.num_dropped += 1
            request.transport.abort()
            return web.Response()
        body = await request.read()
        self.bodies.append(body)
        return web.Response(body=body)


@pytest.mark.unit
def test_a_request_on_a_stale_pooled_connection_is_sent_again_on_a_new_one():
    async def chunks():
        for i in range(20):
            yield f"chunk {i};".encode()

    async def main():
        replica = ClosingReplica()
        await replica.start()
        pool = ReplicaPool.from_urls([f"http://127.0.0.1:{replica.port}"])
        proxy = Proxy(pool, ProxyConfig(port=free_port(), health_interval=60))
        await proxy.start()  # its first health check leaves a kept-alive connection
        try:
            while not pool.replicas[0].is_healthy:
                await asyncio.sleep(0.02)
            async with (
                aiohttp.ClientSession(f"http://127.0.0.1:{proxy.config.port}") as client,
                client.post("/v1/echo", data=chunks()) as response,
            ):
                assert response.status == 200
                assert await response.read() == b"".join(
                    [f"chunk {i};".encode() for i in range(20)]
                )
            assert replica.num_dropped == 1
            assert pool.num_retries == 1
            assert pool.replicas[0].is_healthy  # a stale connection is no replica failure
        finally:
            await proxy.stop()
            await replica.runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_1100_idle_connections_against_serve_under_ulimit_1024(tmp_path):
    """`serve` with two replicas, its open files limited to 1024: 1,100 connections that send
    half a header neither stop it nor keep a keyed request out, and are closed in time."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"this test needs 1,400 open files of its own; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = free_port()
    config = {"port": port, "api_keys": [KEY], "limits": {"header_timeout": 2.0}}
    (tmp_path / "serve.json").write_text(json.dumps(config))

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    command = [sys.executable, "-m", "tests.serve_fakes", "serve", str(tmp_path / "serve.json")]
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_files,
        )
    url = f"http://127.0.0.1:{port}"
    sockets: list[socket.socket] = []
    try:
        wait_healthy(url, serve, timeout=60)
        opened = time.monotonic()
        sockets = half_header_sockets(port, 1100, "127.0.0.1")
        assert keyed_request(url).status_code == 200  # during
        wait_until(
            lambda: all([read_until_closed(s, {}) for s in sockets]),
            2.0 + 10,
            "every idle connection closed",
        )
        assert time.monotonic() - opened < 2.0 + 10
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()
        assert keyed_request(url).status_code == 200  # after
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    finally:
        for sock in sockets:
            sock.close()
        descendants = children_of(serve.pid)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        wait_until(lambda: all(is_gone(p) for p in descendants), 30, "nothing left behind")
