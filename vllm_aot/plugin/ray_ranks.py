"""Our ranks on vLLM's Ray executor (`--distributed-executor-backend ray`).

vLLM's Ray executor asks a placement group for one bundle per rank, each holding one unit of
the platform's `ray_device_key`, and starts one Ray actor per bundle (vLLM's `RayWorkerProc`,
which runs our `AotWorker` as its multiprocessing executor would). A CPU rank needs no device
Ray knows, and Ray refuses "CPU" as a custom resource, so our key is `RAY_RESOURCE`: a custom
resource each node declares once per rank it may host (`ray start --resources
'{"vllm_aot_rank": 1}'`), with its cores the ones the node's `ray start` was given (`taskset`).

One seam is missing: vLLM's Ray worker learns its devices from Ray's `get_accelerator_ids()`,
which lists only the accelerators Ray manages (GPU, TPU, ...), never a custom resource.
`setup_worker_process`, Ray's `worker_process_setup_hook` for the engine's Ray job, answers it
in every Ray worker process before any actor runs: a CPU rank has no device ids.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(f"vllm.{__name__}")

# One unit per rank a node may host; what the platform declares as its `ray_device_key`.
RAY_RESOURCE = "vllm_aot_rank"
SETUP_HOOK = f"{__name__}.setup_worker_process"
_HOOK_KEY = "worker_process_setup_hook"


def with_setup_hook(runtime_env):
    """The engine's Ray runtime environment (`ParallelConfig.ray_runtime_env`, None or the one a
    caller gave) with `SETUP_HOOK` as its worker setup hook; a caller's own hook is refused,
    since a job has one."""
    from ray.runtime_env import RuntimeEnv

    env = dict(runtime_env or {})
    hook = env.get(_HOOK_KEY)
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"vllm-aot does not support a Ray runtime environment with its own {_HOOK_KEY} "
            f"({hook!r}): vllm-aot installs {SETUP_HOOK} there"
        )
    env[_HOOK_KEY] = SETUP_HOOK
    return RuntimeEnv(**env)


def setup_worker_process() -> None:
    """Ray's worker setup hook: vLLM's Ray worker answers that a CPU rank has no device ids (its
    own answer reads `get_accelerator_ids()[RAY_RESOURCE]`, which Ray never lists)."""
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    RayWorkerProc.get_node_and_physical_gpu_ids = _node_and_no_device_ids


def _node_and_no_device_ids(self) -> tuple[str, list[int]]:
    import ray

    return ray.get_runtime_context().get_node_id(), []


def ranks_on_this_node() -> int:
    """How many of the engine's ranks Ray placed on this node (the bundles of this actor's
    placement group that hold `RAY_RESOURCE` here): they share this node's cores."""
    import ray
    from ray.util import get_current_placement_group, placement_group_table

    group = get_current_placement_group()
    if group is None:
        return 1
    table = placement_group_table(group)
    node = ray.get_runtime_context().get_node_id()
    return sum(
        1
        for index, where in table["bundles_to_node_id"].items()
        if where == node and table["bundles"][index].get(RAY_RESOURCE)
    )
