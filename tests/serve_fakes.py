"""Stand-ins for `vllm-aot serve --data-parallel-size N`'s processes, without vLLM (fast).

    python -m tests.serve_fakes replica PORT [--on-sigterm exit|ignore] [--engine]
                                             [--sick-file PATH]
    python -m tests.serve_fakes serve CONFIG_JSON

`replica`: an aiohttp server with /health, an echo (`/v1/echo`), an endless slow event stream
(`/v1/stream`, one event per `delay` s) and a catch-all. `--engine` starts a child that ignores
SIGTERM, as an engine process that outlives its server would. `--on-sigterm exit` leaves at once
(vLLM aborts its requests on SIGTERM), `ignore` never does (only SIGKILL ends it). Its /health
answers 503 while `--sick-file` exists (`{port}` in it is replaced by the replica's port). With
the replica key in its environment it answers 401 to any request without it, as a vLLM replica
with the replica-key middleware does.

`serve`: `serve_replicas` (the real proxy and replica manager) over fake replicas; CONFIG_JSON
holds `port`, `num_replicas`, `replica_args`, and the policy, proxy and connection-limit numbers
to use.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from aiohttp import web

ENGINE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


def health(sick_file: Path | None):
    async def answer(request: web.Request) -> web.Response:
        is_sick = sick_file is not None and sick_file.exists()
        return web.Response(status=503 if is_sick else 200)

    return answer


async def echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


async def stream(request: web.Request) -> web.StreamResponse:
    delay = float(request.query.get("delay", "0.05"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(1_000_000):
        await response.write(f"data: {json.dumps({'i': i})}\n\n".encode())
        await asyncio.sleep(delay)
    return response


async def anything(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path, "pid": os.getpid()})


def replica_key_check(key: str | None):
    """aiohttp middleware doing what `ReplicaKeyMiddleware` does in a vLLM replica."""
    from vllm_aot.plugin.server_guard import (
        REPLICA_CHALLENGE_HEADER,
        REPLICA_KEY_HEADER,
        REPLICA_PROOF_HEADER,
        replica_proof,
    )

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if not key or request.headers.get(REPLICA_KEY_HEADER) == key:
            return await handler(request)
        nonce = request.headers.get(REPLICA_CHALLENGE_HEADER)
        if nonce and (request.method, request.path) == ("GET", "/health"):
            response = await handler(request)
            response.headers[REPLICA_PROOF_HEADER] = replica_proof(key, nonce)
            return response
        return web.json_response({"error": "Unauthorized"}, status=401)

    return check


def run_replica(port: int, on_sigterm: str, has_engine: bool, sick_file: Path | None) -> None:
    if has_engine:
        subprocess.Popen([sys.executable, "-c", ENGINE])
    from vllm_aot.plugin.server_guard import REPLICA_KEY_ENV

    app = web.Application(middlewares=[replica_key_check(os.environ.get(REPLICA_KEY_ENV))])
    app.router.add_get("/health", health(sick_file))
    app.router.add_post("/v1/echo", echo)
    app.router.add_post("/v1/stream", stream)
    app.router.add_route("*", "/{tail:.*}", anything)

    async def main() -> None:
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    handler = signal.SIG_IGN if on_sigterm == "ignore" else (lambda *_: os._exit(0))
    signal.signal(signal.SIGTERM, handler)
    asyncio.run(main())


def replica_command(port: int, replica_args: list[str]) -> tuple[str, ...]:
    return (sys.executable, "-m", "tests.serve_fakes", "replica", str(port), *replica_args)


def run_serve(config: dict) -> int:
    from vllm_aot.processes import free_port
    from vllm_aot.serve.auth import ApiKeys
    from vllm_aot.serve.connections import ConnectionLimits
    from vllm_aot.serve.launch import new_replica_key, replica_launch, serve_replicas
    from vllm_aot.serve.proxy import ProxyConfig
    from vllm_aot.serve.replicas import ReplicaSpec, RestartPolicy

    cores = tuple(sorted(os.sched_getaffinity(0)))
    replica_key = new_replica_key()
    specs = []
    for index in range(config.get("num_replicas", 2)):
        port = free_port()
        command, env = replica_launch(
            list(replica_command(port, config.get("replica_args", []))),
            dict(os.environ),
            replica_key,
        )
        specs.append(ReplicaSpec(index, port, cores, tuple(command), env))
    proxy_config = ProxyConfig(
        port=config["port"],
        health_interval=config.get("health_interval", 0.2),
        health_timeout=config.get("health_timeout", 0.5),
        api_keys=ApiKeys.of(config.get("api_keys", [])),
        limits=ConnectionLimits(**config.get("limits", {})),
        replica_key=replica_key,
    )
    policy = RestartPolicy(**config.get("policy", {}))
    grace = config.get("stop_grace", 10.0)
    return asyncio.run(serve_replicas(specs, proxy_config, policy, None, stop_grace=grace))


if __name__ == "__main__":
    mode, argument, *rest = sys.argv[1:]
    if mode == "replica":

        def option(name: str) -> str | None:
            return rest[rest.index(name) + 1] if name in rest else None

        sick = option("--sick-file")
        sick_file = Path(sick.format(port=argument)) if sick else None
        run_replica(int(argument), option("--on-sigterm") or "exit", "--engine" in rest, sick_file)
    else:
        sys.exit(run_serve(json.loads(Path(argument).read_text())))
