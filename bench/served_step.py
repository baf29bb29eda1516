"""One stream served against the same step in the runtime alone, pass by pass.

Prints, for the bundled GGUF exported once (`vllm-aot export --quantization gguf`) and both
sides running its programs: the runtime's batch-1 decode step (one request's steps, in a process
of its own that keeps the model loaded and waits while the server works) and `vllm-aot serve`'s
time per output token to one streaming client, then their ratio, pair by pair and as medians. A
request's TPOT is a mean (its decode time over its tokens), so the step alone it is set against
is the mean of as many steps; their median is printed beside it (on a noisy host the two differ
by up to ~14 %, the mean the higher). The runtime runs on the cores and threads the server's
steps get (with `VLLM_CPU_NUM_OF_RESERVED_CPU=1`, all but the front end's core). Both sides get
the same prompt (token ids), 128 new tokens after it and the same sampling (temperature 1, as
`vllm bench serve` leaves it, or `--temperature 0` for greedy), so the ratio is what the server
adds around the programs. The host's speed moves from minute to minute (here by over half): a
runtime pass and a served request alternate, seconds apart, and each pair's ratio is read off
its own two figures.

    .venv/bin/python bench/served_step.py [--artifact DIR] [--pairs 8]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from runtime_bench import tokens

from vllm_aot.loading.export_dir import export_model, is_artifact_dir
from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.placement import available_cores, pin_process, split_front_end
from vllm_aot.plugin.front_end import front_end_nice
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.serve.launch import GOMP_SPINCOUNT, server_env

PROMPT_LEN = 128
NEW_TOKENS = 128
MODEL_NAME = "served-step"
CONFIG = RuntimeConfig(dtype="bfloat16", quantization="gguf")  # serve's default, the bundled GGUF


def runtime_passes(artifact: Path, temperature: float) -> None:
    """The runtime alone, as a child process: the model loaded once, then for every line on
    stdin one pass (a prompt's prefill, then its decode steps with the served request's
    sampling), its mean and median step in ms printed as a line."""
    import torch

    from vllm_aot.loading.startup import load_model
    from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
    from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
    from vllm_aot.runtime.sampler import SamplingParams

    # The server's steps' configuration: its compute cores (all of them, or those left beside a
    # core reserved for the front end), a thread each; split as under `vllm-aot serve`'s
    # environment, whose defaults decide the reservation.
    env = server_env()
    compute, _ = split_front_end(available_cores(), env, is_lowered=front_end_nice(env) > 0)
    pin_process(compute)
    torch.set_num_threads(len(compute))
    model, _ = load_model(artifact, CONFIG)
    params = SamplingParams(temperature=temperature).normalized()
    blocks = BlockAllocator(model.config.total_kv_blocks).allocate(
        blocks_needed(PROMPT_LEN + NEW_TOKENS, model.config.block_size)
    )

    def one_pass() -> list[float]:
        out = model.prefill(
            [PrefillChunk(tokens(PROMPT_LEN), 0, blocks)], [RowSampling(params, 7, PROMPT_LEN)]
        )
        last, steps = int(out.tokens[0]), []
        for position in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1):
            start = time.perf_counter()
            out = model.decode(
                [DecodeRow(last, position, blocks)], [RowSampling(params, 7, position + 1)]
            )
            steps.append(time.perf_counter() - start)
            last = int(out.tokens[0])
        return [statistics.mean(steps) * 1000, statistics.median(steps) * 1000]

    one_pass()  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_pass()), flush=True)


def served_tpot_ms(port: int, temperature: float) -> float:
    """One streamed completion: (last token's arrival - first's) / (tokens - 1), the tokens
    counted by the server's usage, not by stream events (vLLM may merge deltas)."""
    body = {
        "model": MODEL_NAME, "prompt": tokens(PROMPT_LEN), "max_tokens": NEW_TOKENS,
        "ignore_eos": True, "temperature": temperature, "seed": 7, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()[:500]
    first = last = None
    count = 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
        if event.get("usage"):
            count = event["usage"]["completion_tokens"]
    connection.close()
    assert count == NEW_TOKENS and first is not None, f"{count} tokens"
    return (last - first) / (count - 1) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, help="exported directory to reuse or create")
    parser.add_argument("--pairs", type=int, default=8, help="runtime passes and served requests")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--serve-args", default="", help="extra `vllm-aot serve` flags")
    parser.add_argument("--runtime-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runtime_child:
        runtime_passes(args.artifact, args.temperature)
        return
    from vllm_aot.testing import free_port, running_server, stop_process

    work = Path(tempfile.mkdtemp(prefix="served-step-"))
    artifact = args.artifact or work / "model"
    if not is_artifact_dir(artifact):
        export_model(prepare_default_model(), artifact, CONFIG, copy_weights=True)
    port = free_port()
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(artifact), "--port",
               str(port), "--served-model-name", MODEL_NAME, *args.serve_args.split()]  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, __file__, "--runtime-child", "--artifact", str(artifact),
         "--temperature", str(args.temperature)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={"GOMP_SPINCOUNT": str(GOMP_SPINCOUNT), **os.environ},  # as `vllm-aot serve` sets
    )  # fmt: skip
    pairs = []
    try:
        with running_server(command, port=port, log_path=work / "serve.log", timeout=1800):
            served_tpot_ms(port, args.temperature)  # warm-up
            for line in child.stdout:  # past anything an import printed
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError("the runtime child exited before its first pass")
            for i in range(args.pairs):
                child.stdin.write("pass\n")
                child.stdin.flush()
                alone, alone_median = json.loads(child.stdout.readline())
                served = served_tpot_ms(port, args.temperature)
                pairs.append((alone, alone_median, served))
                print(f"pair {i + 1}: step alone {alone:.2f} ms (median {alone_median:.2f}), "
                      f"served TPOT {served:.2f} ms")  # fmt: skip
    finally:
        child.stdin.close()
        stop_process(child)
    print_pairs(pairs, args.temperature)
    print(f"results and logs in {work}")


def print_pairs(pairs: list[tuple[float, float, float]], temperature: float) -> None:
    """Pairs of (mean step alone, median step alone, served TPOT), in ms."""
    table = Table(title=f"one stream, {PROMPT_LEN} + {NEW_TOKENS} tokens, temperature "
                  f"{temperature:g}: served TPOT against the runtime's step")  # fmt: skip
    for column in ("pair", "step alone ms (mean)", "(median)", "served TPOT ms", "served / alone"):
        table.add_column(column, justify="right")
    for i, (alone, median, served) in enumerate(pairs, 1):
        table.add_row(
            str(i), f"{alone:.2f}", f"{median:.2f}", f"{served:.2f}", f"{served / alone:.2f}x"
        )
    ratios = [served / alone for alone, _, served in pairs]
    table.add_row(
        "median", *(f"{statistics.median(p[i] for p in pairs):.2f}" for i in range(3)),
        f"{statistics.median(ratios):.2f}x",
    )  # fmt: skip
    Console().print(table)
    within = sum(r <= 1.15 for r in ratios)
    print(f"pairs within 15 % of the step alone: {within} of {len(ratios)}")


if __name__ == "__main__":
    main()
