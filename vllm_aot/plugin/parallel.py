"""Tensor parallelism through vLLM's own machinery: its executors start one `AotWorker` per rank
(the multiprocessing executor on one machine or across machines with `--nnodes`, or Ray), each
worker joins vLLM's process groups here, and our programs' collectives
(`kernels/collectives.py`) go through vLLM's tensor-parallel group: its CPU communicator, shared
memory when all the group's ranks are on one machine, gloo when they are not (`shm_ident`).

A rank other than 0 watches rank 0's rendezvous (`watch_rank0`): vLLM's workers on a follower
node wait for the head's next step forever, so when the head is gone (stopped, or its machine
lost) the rank exits, and its node's executor, seeing a worker die, shuts down.

Each rank takes its own share of the cores it was given (the engine's affinity, or on Ray its
node's: what that node's `ray start` was given), split among the ranks there by local rank
(`placement.rank_cores`), so the ranks' OpenMP teams never contend for a core.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_aot.kernels import collectives
from vllm_aot.placement import available_cores, format_core_list, pin_process, rank_cores

logger = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class RankPlace:
    """Where a worker stands: its tensor-parallel rank and the cores it computes on."""

    tp_rank: int
    tp_size: int
    cores: tuple[int, ...]


class VllmTensorParallel:
    """Our collectives' `Communicator` over vLLM's tensor-parallel group."""

    def __init__(self, group) -> None:
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(x, dim=-1)


def shm_ident(init_method: str, machine: str) -> str:
    """What names the ranks' shared-memory group in vLLM's CPU communicator (`VLLM_DIST_IDENT`):
    the engine's rendezvous as vLLM's CPU worker names it, so another engine's differs, and the
    machine, so ranks on other machines name theirs otherwise: vLLM then joins a group spanning
    machines through gloo, where one shared-memory name would have each rank open segments that
    exist only on the others' machines (pure)."""
    engine = (
        os.path.basename(init_method.removeprefix("file://"))
        if init_method.startswith("file://")
        else init_method.split(":")[-1]
    )
    return f"{engine}-{machine}"


def machine_id() -> str:
    """Ranks share memory only on one machine: its host name (a container's own) and boot."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    text = f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ranks_on_this_machine(parallel) -> int:
    """How many ranks share this process's cores: those Ray placed on this node, or vLLM's
    local world size (the world size over `--nnodes`)."""
    if parallel.use_ray:
        from vllm_aot.plugin.ray_ranks import ranks_on_this_node

        return ranks_on_this_node()
    return parallel.local_world_size


def watch_rank0(
    init_method: str, rank: int, *, interval: float = 2.0, misses: int = 5
) -> threading.Thread | None:
    """On a rank other than 0 of a TCP rendezvous (`tcp://host:port`: several nodes, or Ray),
    a daemon thread that connects to rank 0's store every `interval` seconds and ends this
    process when `misses` attempts in a row fail: rank 0, which hosts the store for the
    engine's life, is gone. None where there is nothing to watch."""
    if rank == 0 or not init_method.startswith("tcp://"):
        return None
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)

    def watch() -> None:
        missed = 0
        while missed < misses:
            time.sleep(interval)
            try:
                with socket.create_connection((host, int(port)), timeout=interval):
                    missed = 0
            except OSError:
                missed += 1
        logger.error(
            "vllm-aot: rank %d lost rank 0's rendezvous at %s:%s for %.0f s (its node is gone); "
            "exiting",
            rank,
            host,
            port,
            interval * misses,
        )
        os._exit(1)

    thread = threading.Thread(target=watch, name="vllm-aot-rank0-watch", daemon=True)
    thread.start()
    logger.info("vllm-aot: rank %d watches rank 0's rendezvous at %s:%s", rank, host, port)
    return thread


def join_ranks(vllm_config, *, rank: int, local_rank: int, init_method: str | None) -> RankPlace:
    """Join vLLM's process groups when there is more than one rank (gloo, as vLLM's CPU platform
    does), install its tensor-parallel group as our programs' communicator, and pin this
    process to its cores."""
    parallel = vllm_config.parallel_config
    cores = available_cores()
    if parallel.world_size == 1:
        return RankPlace(0, 1, cores)
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_tensor_model_parallel_rank,
        get_tp_group,
        init_distributed_environment,
    )

    init_method = init_method or "env://"
    os.environ["VLLM_DIST_IDENT"] = shm_ident(init_method, machine_id())
    init_distributed_environment(parallel.world_size, rank, init_method, local_rank, "gloo")
    ensure_model_parallel_initialized(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    )
    collectives.install(VllmTensorParallel(get_tp_group()))
    # vLLM meets at the master's address across nodes, whatever the worker was given.
    multinode = f"tcp://{parallel.master_addr}:{parallel.master_port}"
    watch_rank0(multinode if parallel.nnodes > 1 else init_method, rank)
    mine = rank_cores(cores, local_rank, _ranks_on_this_machine(parallel))
    pin_process(mine)
    place = RankPlace(get_tensor_model_parallel_rank(), parallel.tensor_parallel_size, mine)
    logger.info(
        "vllm-aot: rank %d (tensor-parallel rank %d of %d) on cores %s",
        rank,
        place.tp_rank,
        place.tp_size,
        format_core_list(mine),
    )
    return place
