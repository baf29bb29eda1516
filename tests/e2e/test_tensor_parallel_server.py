"""`vllm-aot serve --tensor-parallel-size 2`, on vLLM's own multiprocessing executor: a real
server, one worker process per rank, the openai client; answers equal one rank's, and a rank
that dies takes the server down cleanly, named."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Sequence

import psutil
import pytest
import torch

from tests.e2e.conftest import SERVER_ENV, SHAPE_ARGS
from tests.helpers import children_of, cmdline_of, server_on_port, tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk
from vllm_aot.testing import free_port, running_server

PROMPTS = [[(97 * i + 13 * n) % 40000 + 100 for i in range(n)] for n in (5, 40, 90, 17, 3)]
MAX_TOKENS = 10
EXIT_TIMEOUT_S = 60


def tp_command(model_dir, port: int, tp: int, extra: Sequence[str] = ()) -> list[str]:
    """`vllm-aot serve` with `tp` ranks (one replica: it becomes vLLM's server)."""
    return [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(model_dir), "--backend",
            "eager", "--port", str(port), "--tensor-parallel-size", str(tp), *SHAPE_ARGS,
            "--served-model-name", "tiny", *extra]  # fmt: skip


def one_rank_tokens(model_dir) -> list[list[int]]:
    """What one rank generates greedily from PROMPTS (our runtime's Generator)."""
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    requests = [GenerationRequest(p, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    return [r.token_ids for r in Generator(model).generate(requests)]


def served_tokens(url: str) -> list[list[int]]:
    """The server's greedy completions of PROMPTS."""
    client = _client(url)
    return [
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        .choices[0]
        .token_ids
        for prompt in PROMPTS
    ]


@pytest.fixture(scope="module")
def tp_server(tiny_model_dirs, tmp_path_factory):
    """(URL, server process, log path) of a TP=2 server on the tiny Llama (4 heads, 2 KV)."""
    port = free_port()
    log = tmp_path_factory.mktemp("tp") / "server.log"
    command = tp_command(tiny_model_dirs("llama"), port, 2)
    with running_server(command, port=port, env=SERVER_ENV, log_path=log, timeout=300) as url:
        server = server_on_port(port)
        yield url, server, log


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_two_ranks_answer_what_one_rank_computes(tp_server, tiny_model_dirs):
    url, _, log = tp_server
    assert served_tokens(url) == one_rank_tokens(tiny_model_dirs("llama"))
    lines = log.read_text(errors="replace")
    assert "tensor-parallel rank 0 of 2" in lines and "tensor-parallel rank 1 of 2" in lines


def test_sampled_requests_agree_across_ranks(tp_server, tiny_model_dirs):
    """Every rank samples the same token, seeded or not: a rank that drew another would feed
    its shard of the next step a different token, and the logprobs the server reports would
    stop matching one rank's teacher-forced logits over the same text."""
    client = _client(tp_server[0])
    model, _ = load_model(tiny_model_dirs("llama"), tiny_config(), show_progress=False)
    prompt = PROMPTS[1]
    for seed in (11, None):
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            seed=seed,
            logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        tokens = out.choices[0].token_ids
        logits = model.prefill_logits(PrefillChunk([*prompt, *tokens], 0, [1, 2, 3, 4]))
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
        expected = logits.log_softmax(-1)[positions, torch.tensor(tokens)]
        got = torch.tensor(out.choices[0].logprobs.token_logprobs)
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_a_rank_that_dies_takes_the_server_down_naming_it(tp_server):
    """Last in this module: it ends the server."""
    url, server, log = tp_server
    workers = [p for p in children_of(server.pid) if "Worker_TP1" in " ".join(cmdline_of(p))]
    assert len(workers) == 1, [cmdline_of(p) for p in children_of(server.pid)]
    everyone = [server, *children_of(server.pid)]
    workers[0].kill()
    _, alive = psutil.wait_procs(everyone, timeout=EXIT_TIMEOUT_S)
    assert not alive, f"still running {EXIT_TIMEOUT_S} s after rank 1 died: {alive}"
    assert "VllmWorker-1 died unexpectedly" in log.read_text(errors="replace")
    with pytest.raises(OSError):  # nothing listens any more
        urllib.request.urlopen(url + "/health", timeout=5)
