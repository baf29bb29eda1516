"""The proxy against small in-process replicas (aiohttp apps): routing, streaming, failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from tests.serve_fakes import replica_key_check
from vllm_aot.plugin.server_guard import REPLICA_KEY_HEADER
from vllm_aot.serve.auth import ApiKeys
from vllm_aot.serve.pool import ReplicaPool
from vllm_aot.serve.proxy import REPLICA_HEADER, Proxy, ProxyConfig
from vllm_aot.testing import free_port

pytestmark = pytest.mark.unit

METRICS = """\
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 1.0
# HELP vllm:ttft_seconds Time to first token.
# TYPE vllm:ttft_seconds histogram
vllm:ttft_seconds_bucket{le="0.1",model_name="tiny"} 2.0
vllm:ttft_seconds_bucket{le="+Inf",model_name="tiny"} 3.0
vllm:ttft_seconds_count{model_name="tiny"} 3.0
vllm:ttft_seconds_sum{model_name="tiny"} 0.5
"""


@dataclass
class FakeReplica:
    """A replica stand-in: /health, /metrics, an echo, a slow SSE stream, a mid-stream death."""

    index: int
    required_key: str | None = None  # the replica key, when this replica requires one
    port: int = field(default_factory=free_port)
    is_healthy: bool = True
    num_aborted: int = 0
    seen_auth: list[str | None] = field(default_factory=list)
    seen_paths: list[str] = field(default_factory=list)
    seen_keys: list[str | None] = field(default_factory=list)  # replica keys its /health saw
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[replica_key_check(self.required_key)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/echo", self.echo)
        app.router.add_post("/v1/stream", self.stream)
        app.router.add_post("/v1/die", self.die)
        app.router.add_post("/v1/hang-up", self.hang_up)
        app.router.add_post("/v1/engine-dead", self.engine_dead)
        app.router.add_route("*", "/{tail:.*}", self.anything)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def health(self, request):
        self.seen_keys.append(request.headers.get(REPLICA_KEY_HEADER))
        return web.Response(status=200 if self.is_healthy else 503)

    async def metrics(self, request):
        return web.Response(text=METRICS)

    async def echo(self, request):
        self.seen_auth.append(request.headers.get("Authorization"))
        response = web.StreamResponse()
        await response.prepare(request)
        async for chunk in request.content.iter_any():
            await response.write(chunk)
        return response

    async def stream(self, request):
        num_events = int(request.query.get("n", "5"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(num_events):
                await response.write(
                    f"data: {json.dumps({'i': i, 'replica': self.index})}\n\n".encode()
                )
                await asyncio.sleep(0.1)
            await response.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.num_aborted += 1
            raise
        return response

    async def anything(self, request):
        self.seen_paths.append(request.path)
        return web.json_response({"path": request.path})

    async def die(self, request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"i": 0}\n\n')
        request.transport.abort()
        return response

    async def engine_dead(self, request):
        """Answer as vLLM does once its engine died: 500 here, 503 on /health from now on."""
        self.is_healthy = False
        return web.json_response({"error": "EngineCore encountered an issue"}, status=500)

    async def hang_up(self, request):
        """Close the connection before any answer, as a replica told to stop may."""
        await asyncio.sleep(float(request.query.get("after", "0")))
        request.transport.abort()
        return web.Response()


@contextlib.asynccontextmanager
async def proxied(num_replicas: int = 2, **config):
    async with proxied_with_proxy(num_replicas, **config) as (client, replicas, pool, _):
        yield client, replicas, pool


@contextlib.asynccontextmanager
async def proxied_with_proxy(num_replicas: int = 2, **config):
    """`proxied`, and the proxy itself (to stop it as serving stops)."""
    replicas = [FakeReplica(i, config.get("replica_key")) for i in range(num_replicas)]
    for replica in replicas:
        await replica.start()
    pool = ReplicaPool.from_urls([f"http://127.0.0.1:{r.port}" for r in replicas])
    config = ProxyConfig(port=free_port(), **{"health_interval": 0.1, **config})
    proxy = Proxy(pool, config)
    await proxy.start()
    while not all(r.is_started for r in pool.replicas):
        await asyncio.sleep(0.05)
    pool.is_started = True
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{config.port}") as client:
            yield client, replicas, pool, proxy
    finally:
        await proxy.stop()
        for replica in replicas:
            with contextlib.suppress(RuntimeError):
                await replica.stop()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_request_and_response_bodies_stream_through_with_headers():
    async def body_chunks():
        for i in range(50):
            yield f"chunk {i};".encode() * 100

    async def main():
        async with proxied() as (client, replicas, _):
            headers = {"Authorization": "Bearer secret"}
            async with client.post("/v1/echo", data=body_chunks(), headers=headers) as response:
                assert response.status == 200
                body = await response.read()
            assert body == b"".join([f"chunk {i};".encode() * 100 for i in range(50)])
            assert "Bearer secret" in replicas[0].seen_auth + replicas[1].seen_auth

    run(main())


def test_least_loaded_routing_and_round_robin_ties():
    async def main():
        async with proxied() as (client, _, pool):
            seen = []
            for _ in range(4):
                async with client.post("/v1/echo", data=b"x") as response:
                    seen.append(response.headers[REPLICA_HEADER])
            assert seen == ["0", "1", "0", "1"]  # idle replicas: ties rotate
            # A long stream occupies one replica; the next requests all go to the other one.
            async with client.post("/v1/stream", params={"n": "10"}) as busy:
                busy_replica = busy.headers[REPLICA_HEADER]
                for _ in range(3):
                    async with client.post("/v1/echo", data=b"x") as response:
                        assert response.headers[REPLICA_HEADER] != busy_replica
                assert pool.replicas[int(busy_replica)].num_in_flight == 1
                await busy.read()

    run(main())


def test_unhealthy_replica_is_ejected_and_readmitted():
    async def main():
        async with proxied() as (client, replicas, pool):
            replicas[1].is_healthy = False
            while pool.replicas[1].is_healthy:
                await asyncio.sleep(0.05)
            for _ in range(3):
                async with client.post("/v1/echo", data=b"x") as response:
                    assert response.headers[REPLICA_HEADER] == "0"
            async with client.get("/health") as response:
                assert response.status == 200  # one healthy replica is enough
                report = await response.json()
            assert [r["healthy"] for r in report["replicas"]] == [True, False]
            replicas[0].is_healthy = False
            while pool.replicas[0].is_healthy:
                await asyncio.sleep(0.05)
            async with client.get("/health") as response:
                assert response.status == 503
            async with client.post("/v1/echo", data=b"x") as response:
                assert response.status == 503
            replicas[1].is_healthy = True
            while not pool.replicas[1].is_healthy:
                await asyncio.sleep(0.05)
            async with client.post("/v1/echo", data=b"x") as response:
                assert response.headers[REPLICA_HEADER] == "1"
            assert pool.replicas[1].num_ejections == 1

    run(main())


def test_connection_refused_is_retried_once_on_another_replica():
    async def main():
        # Long health interval: the proxy still believes replica 0 is healthy when it is gone.
        async with proxied(health_interval=60) as (client, replicas, pool):
            await replicas[0].stop()
            for _ in range(2):
                async with client.post("/v1/echo", data=b"hello") as response:
                    assert response.status == 200
                    assert response.headers[REPLICA_HEADER] == "1"
                    assert await response.read() == b"hello"
            assert pool.num_retries == 1  # the first request found it; it was then ejected
            assert not pool.replicas[0].is_healthy
            async with client.get("/metrics") as response:
                text = await response.text()
            assert "vllm_aot_proxy_retries_total 1" in text
            assert 'vllm_aot_proxy_ejections_total{replica="0"} 1' in text

    run(main())


def test_a_replica_answering_500_is_checked_at_once_and_ejected_when_its_health_fails():
    async def main():
        # Long health interval: only the check a 500 sets off can eject it in time.
        async with proxied(health_interval=60) as (client, _, pool):
            async with client.post("/v1/engine-dead", data=b"x") as response:
                assert response.status == 500
                dead = int(response.headers[REPLICA_HEADER])
            for _ in range(100):
                if not pool.replicas[dead].is_healthy:
                    break
                await asyncio.sleep(0.05)
            assert not pool.replicas[dead].is_healthy
            for _ in range(4):  # every request goes to the other one
                async with client.post("/v1/echo", data=b"hello") as response:
                    assert response.headers[REPLICA_HEADER] == str(1 - dead)

    run(main())


def test_replica_dying_mid_stream_ends_the_stream_with_an_error_and_is_not_retried():
    async def main():
        async with proxied() as (client, _, pool):
            async with client.post("/v1/die") as response:
                assert response.status == 200
                body = (await response.read()).decode()
            assert body.startswith('data: {"i": 0}')
            assert '"error"' in body.splitlines()[-2]
            assert pool.num_retries == 0
            assert sum(r.num_errors for r in pool.replicas) == 1

    run(main())


def test_replica_hanging_up_before_an_answer_gets_502_or_503_while_the_server_stops():
    async def main():
        async with proxied_with_proxy(num_replicas=1) as (client, _, pool, proxy):
            async with client.post("/v1/hang-up") as response:
                assert response.status == 502
                assert "replica 0 failed" in (await response.json())["error"]["message"]
            pending = asyncio.create_task(client.post("/v1/hang-up", params={"after": "0.5"}))
            while pool.replicas[0].num_in_flight == 0:
                await asyncio.sleep(0.01)
            await proxy.stop_accepting()  # SIGTERM: the replica is told to stop too
            async with await pending as response:
                assert response.status == 503
                assert "shutting down" in (await response.json())["error"]["message"]

    run(main())


def test_client_disconnect_aborts_the_upstream_request():
    async def main():
        async with proxied() as (client, replicas, pool):
            async with client.post("/v1/stream", params={"n": "100"}) as response:
                await response.content.readline()
                index = int(response.headers[REPLICA_HEADER])
                response.close()  # the client goes away mid-stream
            for _ in range(50):
                if replicas[index].num_aborted:
                    break
                await asyncio.sleep(0.05)
            assert replicas[index].num_aborted == 1
            assert pool.replicas[index].num_in_flight == 0

    run(main())


def test_body_over_the_limit_gets_413():
    async def chunks():
        for _ in range(20):
            yield b"x" * 1000

    async def main():
        async with proxied(max_body_bytes=5000) as (client, _, _pool):
            async with client.post("/v1/echo", data=b"x" * 6000) as response:
                assert response.status == 413  # Content-Length says so up front
            async with client.post("/v1/echo", data=chunks()) as response:
                assert response.status in (413, 200)  # chunked: refused while streaming
                if response.status == 200:  # headers were already on their way
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await response.read()

    run(main())


def test_metrics_merge_every_replicas_series_with_a_replica_label():
    async def main():
        async with proxied() as (client, _, _pool), client.get("/metrics") as response:
            assert response.status == 200
            lines = (await response.text()).splitlines()
        assert lines.count("# TYPE vllm:ttft_seconds histogram") == 1
        for replica in ("0", "1"):
            assert (
                f'vllm:num_requests_running{{replica="{replica}",model_name="tiny"}} 1.0' in lines
            )
            assert f'vllm:ttft_seconds_sum{{replica="{replica}",model_name="tiny"}} 0.5' in lines
            assert f'vllm_aot_proxy_in_flight{{replica="{replica}"}} 0' in lines
        # A family's samples stay together, after its TYPE line (Prometheus text format).
        start = lines.index("# TYPE vllm:ttft_seconds histogram")
        assert all(line.startswith("vllm:ttft_seconds") for line in lines[start + 1 : start + 9])

    run(main())


# vLLM's --api-key guards /v1, /v2, /inference and /cohere only; the proxy guards every path.
GUARDED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v2/embeddings"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/pooling"),
    ("POST", "/score"),
    ("POST", "/classify"),
    ("POST", "/rerank"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("GET", "/version"),
    ("GET", "/ping"),
    ("POST", "/health"),  # not the proxy's own /health: it would reach a replica
    ("GET", "/metrics"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_api_key_guards_every_path_before_any_replica_sees_it(method, path):
    async def main():
        keys = ApiKeys.of(["key-one", "key-two"])
        async with proxied(api_keys=keys) as (client, replicas, _):
            for authorization in (None, "Bearer wrong", "Basic key-one", "bearer", "key-one"):
                headers = {"Authorization": authorization} if authorization else {}
                async with client.request(method, path, headers=headers) as response:
                    assert response.status == 401, (authorization, response.status)
                    assert await response.json() == {"error": "Unauthorized"}  # vLLM's own
            assert [p for r in replicas for p in r.seen_paths] == []
            headers = {"Authorization": "Bearer key-two"}
            async with client.request(method, path, headers=headers) as response:
                assert response.status == 200

    run(main())


def test_health_is_public_and_metrics_only_when_exposed():
    async def main():
        keys = ApiKeys.of(["k"])
        async with proxied(api_keys=keys) as (client, _, _pool):
            async with client.get("/health") as response:
                assert response.status == 200
            async with client.get("/metrics") as response:
                assert response.status == 401
        async with proxied(api_keys=keys, is_metrics_public=True) as (client, _, _pool):
            async with client.get("/metrics") as response:
                assert response.status == 200
                assert "vllm_aot_proxy_requests_total" in await response.text()
            async with client.post("/v1/echo", data=b"x") as response:
                assert response.status == 401

    run(main())
