"""Run a function on several tensor-parallel ranks of this machine: one spawned process each, a
`torch.distributed` gloo group between them, our collectives (`kernels/collectives.py`) installed
over it; each rank's result comes back.

For the tools that drive the runtime themselves (`vllm-aot validate`, `tensors`, `demo`) and
tests. Serving never runs here: vLLM's executors start its ranks, on one machine or many.
Ranks other than 0 run with their output silenced (they compute what rank 0 reports).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import random
import traceback
from collections.abc import Callable
from typing import Any

from vllm_aot.placement import available_cores, pin_process, rank_cores
from vllm_aot.processes import free_port


def _rank_main(fn, args, rank: int, world_size: int, port: int, results, quiet: bool) -> None:
    import torch
    import torch.distributed as dist

    from vllm_aot.kernels import collectives

    try:
        if quiet and rank:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        mine = rank_cores(available_cores(), rank, world_size)
        pin_process(mine)
        torch.set_num_threads(len(mine))
        # The same random draws on every rank (seeds of requests that brought none).
        random.seed(port)
        torch.manual_seed(port)
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


def _raise_if_one_died(procs, reported: dict[int, Any]) -> None:
    """RuntimeError naming a rank whose process ended without reporting (killed, crashed)."""
    for rank, proc in enumerate(procs):
        if rank not in reported and proc.exitcode not in (None, 0):
            raise RuntimeError(
                f"rank {rank} of {len(procs)} exited with code {proc.exitcode} without a result"
            )


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, quiet: bool = False
) -> list[Any]:
    """`fn(rank, *args)` on ranks 0..world_size-1 (a module-level function: spawned processes
    import it), each on its share of this process's cores (`placement.rank_cores`: with fewer
    cores than ranks, they share); their results in rank order. A rank's exception raises
    RuntimeError here, naming the rank. `quiet`: ranks other than 0 print nothing."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, args, rank, world_size, port, results, quiet))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        got: dict[int, Any] = {}
        while len(got) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                _raise_if_one_died(procs, got)
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            got[rank] = pickle.loads(value)
        return [got[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
