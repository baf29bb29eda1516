"""Run `vllm.LLM` on our platform in a process of its own; print one line of JSON results.

Usage: python offline_llm.py SPEC_JSON, where the spec names the model directory, the engine
keyword arguments, the token prompts and max_tokens for `llm.generate`, and the messages for
`llm.chat`; or, for an embedding model, the sentences (or token ids) for `llm.embed`. vLLM
logs go to stderr (VLLM_LOGGING_STREAM), so stdout carries the result line, marked with
RESULT_PREFIX so any stray print cannot be mistaken for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "OFFLINE_LLM_RESULT "
# What the engine's process needs: a small KV pool, logs on stderr.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_offline_llm(spec: dict, log: Path, timeout: float) -> dict:
    """This script on `spec` in a subprocess (its stderr in `log`) -> its JSON result; raises
    AssertionError with the stdout and the log's tail when it fails."""
    start = time.monotonic()
    with open(log, "wb") as stderr:
        proc = subprocess.run(
            [sys.executable, __file__, json.dumps(spec)],
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=stderr,
            timeout=timeout,
            check=False,
        )
    stdout = proc.stdout.decode(errors="replace")
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or len(lines) != 1:
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(
            f"vllm.LLM subprocess exited with {proc.returncode} after "
            f"{time.monotonic() - start:.0f} s and {len(lines)} result lines; "
            f"stdout:\n{stdout[-2000:]}\nlog tail:\n{tail}"
        )
    return json.loads(lines[0].removeprefix(RESULT_PREFIX))


def main(spec: dict) -> dict:
    from vllm import LLM

    start = time.monotonic()
    llm = LLM(model=spec["model"], **spec["engine"])
    started = time.monotonic() - start
    try:
        return _results(llm, spec, started)
    finally:
        # The engine stopped here, not by the interpreter's teardown: left to it, a process
        # under load once in a few runs aborted after printing its result ("terminate called
        # without an active exception": a C++ thread still joinable while it was torn down).
        llm.llm_engine.engine_core.shutdown()


def _results(llm, spec: dict, started: float) -> dict:
    from vllm import SamplingParams

    if "sentences" in spec:
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in spec["sentences"]]
        outputs = llm.embed(prompts, use_tqdm=False)
        return {"startup_seconds": started, "embeddings": [o.outputs.embedding for o in outputs]}

    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_token_ids"]]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    generated = [
        {
            "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(out.outputs[0].token_ids),
            "finish_reason": out.outputs[0].finish_reason,
            "text": out.outputs[0].text,
        }
        for out in outputs
    ]

    chat_params = SamplingParams(temperature=0.0, max_tokens=spec["chat_max_tokens"])
    (chat,) = llm.chat(spec["messages"], chat_params, use_tqdm=False)
    return {
        "startup_seconds": started,
        "platform": type(_current_platform()).__name__,
        "generate": generated,
        "chat": {
            "prompt_token_ids": list(chat.prompt_token_ids),
            "token_ids": list(chat.outputs[0].token_ids),
            "text": chat.outputs[0].text,
        },
    }


def _current_platform():
    from vllm.platforms import current_platform

    return current_platform


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
