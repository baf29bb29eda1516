"""A Ray cluster of several nodes on this machine, started from Ray's CLI as on real machines:
`ray start --head` for the first node, `ray start --address` for the others, each declaring one
`vllm_aot_rank` (the platform's Ray resource) and pinned to its own core when there are enough.

Where this process may create namespaces (root, `unshare`), every node but the head runs in its
own UTS and mount namespace: its own host name and its own /dev/shm, so ranks on it share no
memory with the head's, as on another machine.

Each node is one `ray start --block` process, stopped by SIGTERM (it drains its node and stops
the node's processes), then anything left is killed: `ray stop` would stop every Ray cluster on
this machine, other people's too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.helpers import children_of, cmdline_of
from vllm_aot.testing import free_port

READY_LINE = "block forever"  # what `ray start --block` prints once its node has joined
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
# In a node's own namespaces: its own /dev/shm and host name ($0), then the command ($@).
_ISOLATE = 'mount -t tmpfs tmpfs /dev/shm && hostname "$0" && exec "$@"'


@dataclass
class RayCluster:
    address: str  # the head's GCS, host:port, what RAY_ADDRESS names
    nodes: list[subprocess.Popen]
    logs: list[Path]
    isolated: bool  # the nodes after the head have their own host name and /dev/shm

    def processes(self, index: int) -> list[psutil.Process]:
        """Node `index`'s processes: its `ray start` and all under it (raylet, workers, actors)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.nodes[index].pid)
            return [root, *children_of(root.pid)]
        return []


def can_isolate() -> bool:
    """Whether this process may give a node its own host name and /dev/shm."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(_isolated(["true"], "probe"), capture_output=True, timeout=30)
    return probe.returncode == 0


def _isolated(command: list[str], name: str) -> list[str]:
    return ["unshare", "--mount", "--uts", "--fork", "sh", "-c", _ISOLATE, name, *command]


def _node_command(index: int, head_port: int, temp_dir: Path) -> list[str]:
    ray = str(Path(sys.executable).parent / "ray")
    common = [
        "--block",
        "--num-cpus=1",
        '--resources={"vllm_aot_rank": 1}',
        "--node-ip-address=127.0.0.1",
        f"--object-store-memory={100 * 2**20}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    if index > 0:
        return [ray, "start", f"--address=127.0.0.1:{head_port}", *common]
    return [
        ray,
        "start",
        "--head",
        f"--port={head_port}",
        "--include-dashboard=false",
        f"--dashboard-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}",
        *common,
    ]


def _wait_ready(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while READY_LINE not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ray node did not start (exit {process.poll()}):\n{tail}")
        time.sleep(0.5)


def _start_node(cluster: RayCluster, head_port: int, temp_dir: Path, core: int | None) -> None:
    index = len(cluster.nodes)
    command = _node_command(index, head_port, temp_dir)
    if cluster.isolated and index > 0:
        command = _isolated(command, f"ray-node-{index}")
    log = temp_dir.with_name(f"{temp_dir.name}-node{index}.log")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if core is None else (lambda: os.sched_setaffinity(0, {core})),
        )
    cluster.nodes.append(process)
    cluster.logs.append(log)
    _wait_ready(process, log)


def stop(cluster: RayCluster) -> list[psutil.Process]:
    """SIGTERM each node's `ray start` (the others before the head), then kill what is left;
    returns what still runs after that (nothing, unless something escaped)."""
    seen: list[psutil.Process] = []
    for index in reversed(range(len(cluster.nodes))):
        processes = cluster.processes(index)
        seen += processes
        for process in processes:
            if "start" in (argv := cmdline_of(process)) and "--block" in argv:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.terminate()
        _, alive = psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    _, alive = psutil.wait_procs(seen, timeout=10)
    return alive


@contextlib.contextmanager
def local_ray_cluster(num_nodes: int = 2) -> Iterator[RayCluster]:
    """`num_nodes` Ray nodes on this machine, each with one `vllm_aot_rank`; always stopped.
    Raises AssertionError if a process of the cluster outlives the stop."""
    # Ray's socket paths must stay short: a short directory of its own under /tmp.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cores = sorted(os.sched_getaffinity(0))
    pins = cores[:num_nodes] if len(cores) >= num_nodes else [None] * num_nodes
    head_port = free_port()
    cluster = RayCluster(f"127.0.0.1:{head_port}", [], [], can_isolate())
    try:
        for core in pins:
            _start_node(cluster, head_port, temp_dir, core)
        yield cluster
    finally:
        alive = stop(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)
        for log in cluster.logs:
            log.unlink(missing_ok=True)
    assert not alive, f"Ray processes outlived the cluster: {alive}"
