"""Tensor parallelism across machines through vLLM's multiprocessing executor: two processes on
loopback stand in for two nodes (`--nnodes 2`, the second `--headless`), one rank each; answers
equal one rank's, and a rank that dies takes both nodes down."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from tests.e2e.test_tensor_parallel_server import MAX_TOKENS, PROMPTS, one_rank_tokens
from tests.helpers import children_of, cmdline_of, server_on_port
from vllm_aot.testing import free_port, running_server

EXIT_TIMEOUT_S = 90


def node_command(model_dir, *, node_rank: int, master_port: int, port: int) -> list[str]:
    """`vllm-aot serve` for one of two nodes, as docs/parallelism.md tells users to run it."""
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(model_dir)]
    command += ["--backend", "eager", *SHAPE_ARGS, "--served-model-name", "tiny"]
    command += ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node_rank)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    return [*command, "--port", str(port)] if node_rank == 0 else [*command, "--headless"]


@contextlib.contextmanager
def started_nodes(model_dir, logs: Path):
    """(URL, head process, follower process, head log, follower log) of two nodes on loopback,
    both stopped afterwards."""
    port, master_port = free_port(), free_port()
    follower_log = open(logs / "node1.log", "wb")  # noqa: SIM115 -- closed below
    follower = subprocess.Popen(
        node_command(model_dir, node_rank=1, master_port=master_port, port=port),
        env={**os.environ, **SERVER_ENV},
        stdout=follower_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # as on another machine: no signal of the head's reaches it
    )
    head_command = node_command(model_dir, node_rank=0, master_port=master_port, port=port)
    try:
        with running_server(
            head_command, port=port, env=SERVER_ENV, log_path=logs / "node0.log", timeout=300
        ) as url:
            head = server_on_port(port)
            yield url, head, psutil.Process(follower.pid), logs / "node0.log", logs / "node1.log"
    finally:
        follower.kill()
        follower.wait()
        follower_log.close()


@pytest.fixture(scope="module")
def two_nodes(tiny_model_dirs, tmp_path_factory):
    with started_nodes(tiny_model_dirs("llama"), tmp_path_factory.mktemp("nodes")) as nodes:
        yield nodes


def test_two_nodes_answer_what_one_rank_computes(two_nodes, tiny_model_dirs):
    import openai

    client = openai.OpenAI(base_url=f"{two_nodes[0]}/v1", api_key="unused", max_retries=0)
    for prompt, tokens in zip(PROMPTS, one_rank_tokens(tiny_model_dirs("llama")), strict=True):
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].token_ids == tokens
    assert "tensor-parallel rank 1 of 2" in two_nodes[4].read_text(errors="replace")


def test_a_rank_that_dies_takes_both_nodes_down(two_nodes):
    """The follower's rank dies: its node's executor notices and exits; the head's next
    collective fails, which is fatal on several ranks, and its server exits."""
    url, head, follower, _, follower_log = two_nodes
    (rank,) = [p for p in children_of(follower.pid) if "Worker" in " ".join(cmdline_of(p))]
    everyone = [head, *children_of(head.pid), follower, *children_of(follower.pid)]
    rank.kill()
    with pytest.raises(OSError):  # a request reaches the collectives, or the server is gone
        urllib.request.urlopen(
            urllib.request.Request(
                url + "/v1/completions",
                data=b'{"model": "tiny", "prompt": [100, 200], "max_tokens": 4}',
                headers={"Content-Type": "application/json"},
            ),
            timeout=EXIT_TIMEOUT_S,
        )
    _, alive = psutil.wait_procs(everyone, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"still running {EXIT_TIMEOUT_S} s after a rank died: {alive}"
    assert "died unexpectedly" in follower_log.read_text(errors="replace")


@pytest.mark.slow
def test_the_follower_leaves_when_the_head_stops(tiny_model_dirs, tmp_path):
    """vLLM's follower would wait for the head's next step forever; its rank notices rank 0's
    rendezvous is gone and exits, and the follower's executor shuts the node down."""
    with started_nodes(tiny_model_dirs("llama"), tmp_path) as (_, head, follower, _, log):
        everyone = [follower, *children_of(follower.pid)]
        head.terminate()
        _, alive = psutil.wait_procs(everyone, timeout=EXIT_TIMEOUT_S)
        assert not alive, f"the follower still runs {EXIT_TIMEOUT_S} s after the head stopped"
        assert "lost rank 0's rendezvous" in log.read_text(errors="replace")
