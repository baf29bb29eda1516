"""Run `vllm.LLM` on our platform in a process of its own; print one line of JSON results.

Usage: python offline_llm.py SPEC_JSON, where the spec names the model directory, the engine
keyword arguments, the token prompts and max_tokens for `llm.generate`, and the messages for
`llm.chat`; or, for an embedding model, the sentences (or token ids) for `llm.embed`. vLLM
logs go to stderr (VLLM_LOGGING_STREAM), so stdout carries the result line, marked with
RESULT_PREFIX so any stray print cannot be mistaken for it.
"""

from __future__ import annotations

import json
import sys
import time

RESULT_PREFIX = "OFFLINE_LLM_RESULT "


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    llm = LLM(model=spec["model"], **spec["engine"])
    started = time.monotonic() - start
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
