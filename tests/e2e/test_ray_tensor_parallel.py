"""`--tensor-parallel-size 2 --distributed-executor-backend ray` on a Ray cluster of two nodes
started from Ray's CLI on this machine (`ray_cluster.py`; the second node has its own host name
and /dev/shm where namespaces can be had): vLLM's Ray executor runs one rank on each node as a
Ray actor, greedy answers equal one rank's, a rank that dies takes the server down naming it,
and stopping the cluster leaves no process behind."""

from __future__ import annotations

import re
import urllib.request

import psutil
import pytest

from tests.e2e.conftest import SERVER_ENV
from tests.e2e.ray_cluster import local_ray_cluster, stop
from tests.e2e.test_tensor_parallel_server import one_rank_tokens, served_tokens, tp_command
from tests.helpers import children_of, cmdline_of, server_on_port
from vllm_aot.testing import free_port, running_server

pytest.importorskip("ray", reason="ray is not installed (pip install ray, or the dev extra)")
pytestmark = pytest.mark.slow  # two Ray nodes and a server: 45-70 s on two cores

EXIT_TIMEOUT_S = 60
RANK_LINE = r"RayWorkerProc pid={pid}\).*vllm-aot: rank (\d) \(tensor-parallel rank"


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(num_nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tiny_model_dirs, tmp_path_factory):
    """(URL, server process, log path) of a TP=2 server on the tiny Llama, ranks on Ray."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray-tp") / "server.log"
    extra = ["--distributed-executor-backend", "ray"]
    command = tp_command(tiny_model_dirs("llama"), port, 2, extra)
    # Every rank's lines, not Ray's summary of similar ones.
    env = {**SERVER_ENV, "RAY_ADDRESS": ray_cluster.address, "RAY_DEDUP_LOGS": "0"}
    with running_server(command, port=port, env=env, log_path=log, timeout=400) as url:
        server = server_on_port(port)
        yield url, server, log


def _actors(cluster, node: int) -> list[psutil.Process]:
    """The vLLM worker actors Ray runs on `node`."""
    return [p for p in cluster.processes(node) if "RayWorkerProc" in " ".join(cmdline_of(p))]


def test_a_rank_on_each_ray_node_answers_what_one_rank_computes(
    ray_server, ray_cluster, tiny_model_dirs
):
    url, _, log = ray_server
    assert served_tokens(url) == one_rank_tokens(tiny_model_dirs("llama"))
    assert len(_actors(ray_cluster, 0)) == 1 and len(_actors(ray_cluster, 1)) == 1
    lines = log.read_text(errors="replace")
    assert "tensor-parallel rank 0 of 2" in lines and "tensor-parallel rank 1 of 2" in lines
    if ray_cluster.isolated:  # no memory shared between the nodes: vLLM's gloo between them
        assert "CPU SHM communicator disabled for group tp" in lines


def test_a_rank_that_dies_takes_the_server_down_naming_it(ray_server, ray_cluster):
    """vLLM's Ray executor watches its actors: the other node's rank killed, the engine and the
    server stop, the rank named, and the surviving rank's actor is stopped too."""
    url, server, log = ray_server
    (victim,) = _actors(ray_cluster, 1)
    (survivor,) = _actors(ray_cluster, 0)
    rank = re.search(RANK_LINE.format(pid=victim.pid), log.read_text(errors="replace"))
    assert rank, f"no rank line of actor {victim.pid}"
    everyone = [server, *children_of(server.pid), survivor]
    victim.kill()
    _, alive = psutil.wait_procs(everyone, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"still running {EXIT_TIMEOUT_S} s after a rank died: {alive}"
    died = f"RayWorkerProc rank=[{rank.group(1)}] died unexpectedly"
    assert died in log.read_text(errors="replace")
    with pytest.raises(OSError):  # nothing listens any more
        urllib.request.urlopen(url + "/health", timeout=5)


def test_stopping_the_cluster_leaves_no_process_behind(ray_cluster):
    processes = ray_cluster.processes(0) + ray_cluster.processes(1)
    assert processes
    assert not stop(ray_cluster)
    assert not [p for p in processes if p.is_running()]
