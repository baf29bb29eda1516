"""The proxy's keys and the replicas' key, against small in-process replicas: keys as vLLM parses
them, OPTIONS and CORS preflights, the replica key on every request to a replica, admission only
for a replica that proves the key, `/health` without addresses."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.test_serve_proxy import FakeReplica, proxied, run
from vllm_aot.plugin.engine_flags import parse_vllm_flags
from vllm_aot.plugin.server_guard import REPLICA_KEY_HEADER, CorsSettings
from vllm_aot.serve.auth import ApiKeys
from vllm_aot.serve.pool import ReplicaPool
from vllm_aot.serve.proxy import REPLICA_HEADER, Proxy, ProxyConfig
from vllm_aot.testing import free_port

pytestmark = pytest.mark.unit


def test_keys_from_a_config_file_or_an_abbreviation_are_enforced(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("api-key: from-yaml\n")

    given = {"from-yaml": ("--config", str(config)), "short": ("--api-k", "short")}
    # vLLM's parser (imported on the first call) outside the test's 30 s
    parsed = {
        key: ApiKeys.from_vllm(parse_vllm_flags(args).api_key, {}) for key, args in given.items()
    }

    async def main():
        for key, keys in parsed.items():
            async with proxied(api_keys=keys) as (client, replicas, _):
                async with client.post("/invocations", data=b"x") as response:
                    assert response.status == 401
                assert [p for r in replicas for p in r.seen_paths] == []
                headers = {"Authorization": f"Bearer {key}"}
                async with client.post("/invocations", data=b"x", headers=headers) as response:
                    assert response.status == 200

    run(main())


def test_options_needs_a_key_and_preflights_are_answered_by_the_proxy():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}

    async def main():
        cors = CorsSettings(allowed_origins=("https://app.example",))
        async with proxied(api_keys=ApiKeys.of(["k"]), cors=cors) as (client, replicas, _):
            for path in ("/metrics", "/v1/echo", "/tokenize"):
                async with client.options(path) as response:
                    assert response.status == 401
                    assert "vllm" not in await response.text()
                async with client.options(path, headers=preflight) as response:
                    assert response.status == 200
                    allowed = response.headers["Access-Control-Allow-Origin"]
                    assert allowed == "https://app.example"
                    assert "POST" in response.headers["Access-Control-Allow-Methods"]
                    assert REPLICA_HEADER not in response.headers
            other = {**preflight, "Origin": "https://evil.example"}
            async with client.options("/v1/echo", headers=other) as response:
                assert response.status == 400
                assert "Access-Control-Allow-Origin" not in response.headers
            assert [p for r in replicas for p in r.seen_paths] == []
            headers = {"Authorization": "Bearer k"}
            async with client.options("/tokenize", headers=headers) as response:
                assert response.status == 200 and REPLICA_HEADER in response.headers
        async with proxied() as (client, replicas, _):  # no keys: preflights still stay here
            async with client.options("/v1/echo", headers=preflight) as response:
                assert response.status == 400  # vLLM's default: no origin allowed
            assert [p for r in replicas for p in r.seen_paths] == []

    run(main())


def test_replicas_get_the_replica_key_and_health_names_no_address():
    async def main():
        keys = ApiKeys.of(["client-key"])
        async with proxied(api_keys=keys, replica_key="rk") as (client, replicas, pool):
            # The health checks passed (proxied waits for them): they carry the key.
            headers = {"Authorization": "Bearer client-key", REPLICA_KEY_HEADER: "forged"}
            async with client.get("/tokenize", headers=headers) as response:
                assert response.status == 200
            async with client.get("/metrics", headers=headers) as response:
                assert 'vllm:num_requests_running{replica="0",model_name="tiny"}' in (
                    await response.text()
                )
            async with client.get("/health") as response:
                report = await response.json()
            text = json.dumps(report)
            assert all(str(r.port) not in text for r in replicas) and "127.0.0.1" not in text
            assert [r["replica"] for r in report["replicas"]] == [0, 1]
            assert all(r["healthy"] for r in report["replicas"])
            url = f"{pool.replicas[0].url}/tokenize"  # the replica itself: no key, no entry
            async with aiohttp.ClientSession() as direct, direct.get(url) as response:
                assert response.status == 401

    run(main())


def test_health_says_why_a_replica_is_down_without_its_address():
    async def main():
        async with proxied() as (client, replicas, pool):
            await replicas[1].stop()
            while pool.replicas[1].is_healthy:
                await asyncio.sleep(0.05)
            async with client.get("/health") as response:
                report = await response.json()
            problem = report["replicas"][1]["problem"]
            assert problem.startswith("/health failed: ClientConnectorError")
            assert str(replicas[1].port) not in problem and "127.0.0.1" not in problem

    run(main())


def test_a_process_on_a_replica_port_without_the_key_is_never_admitted():
    """Another process on a (restarting) replica's port answers every health check with 200; it
    cannot prove the replica key, so it gets no request, no scrape and never the key."""

    async def main():
        real, impostor = FakeReplica(0, "rk"), FakeReplica(1)
        for replica in (real, impostor):
            await replica.start()
        urls = [f"http://127.0.0.1:{r.port}" for r in (real, impostor)]
        pool = ReplicaPool.from_urls(urls)
        config = ProxyConfig(port=free_port(), health_interval=0.05, replica_key="rk")
        proxy = Proxy(pool, config)
        await proxy.start()
        try:
            while len(impostor.seen_keys) < 3 or not pool.replicas[0].is_started:
                await asyncio.sleep(0.05)
            pool.is_started = True
            async with aiohttp.ClientSession(f"http://127.0.0.1:{config.port}") as client:
                for _ in range(4):
                    async with client.post("/v1/echo", data=b"x") as response:
                        assert response.headers[REPLICA_HEADER] == "0"
                async with client.get("/metrics") as response:
                    assert response.status == 200
                async with client.get("/health") as response:
                    report = await response.json()
            assert not pool.replicas[1].is_healthy and not pool.replicas[1].is_started
            assert "without the replica key's proof" in report["replicas"][1]["problem"]
            assert impostor.seen_paths == [] and set(impostor.seen_keys) == {None}
        finally:
            await proxy.stop()
            for replica in (real, impostor):
                await replica.stop()

    run(main())
