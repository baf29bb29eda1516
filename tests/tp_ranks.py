"""Run a function on several tensor-parallel ranks: one spawned process each, a gloo group
between them, our collectives installed over it; each rank's result comes back (tests)."""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from vllm_aot.processes import free_port

RANK_TIMEOUT_S = 600.0


def _rank_main(fn, args, rank: int, world_size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from vllm_aot.kernels import collectives

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        collectives.install(collectives.TorchDistributed())
        # Plain pickle: torch's own reduction would share tensors through memory that dies
        # with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
        dist.destroy_process_group()
    except BaseException:  # the parent reports it, with the rank
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(rank, *args)` on ranks 0..world_size-1 (a module-level function: spawned processes
    import it); their results in rank order. A rank's exception fails here, naming the rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args, rank, world_size, port, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        got = {}
        for _ in range(world_size):
            rank, status, value = results.get(timeout=RANK_TIMEOUT_S)
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            got[rank] = pickle.loads(value)
        return [got[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
