"""perf_bench's speculative-decoding pieces: the copy-heavy case and vLLM's spec-decode counters.

The `copy` case is chat requests asking to repeat, correct or rewrite a given paragraph
(`COPY_PROMPTS`), greedy, 128 tokens with ignore-eos: what editing and summarising a given text
looks like, where prompt-lookup (n-gram) drafts match. The paragraph is long enough (about 190
tokens) that every answer is still going at its 128th token, so the case measures the answers
themselves: with the first, 80-token paragraph a third of each request's tokens came after the
model's end of turn (ignore-eos), a new conversation it made up, which no lookup can draft.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

_TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the bay. Every evening the "
    "keeper climbed its one hundred and twelve steps, trimmed the wick, polished the great lens "
    "and lit the lamp, and every morning he wrote the weather, the ships he had seen and the "
    "state of the sea in a leather logbook that his grandfather had started sixty years before. "
    "In the winter storms the waves broke over the gallery rail, and the salt crusted the "
    "windows so thickly that he had to scrape them clean twice in a single night. In the summer "
    "the fishing boats came in late, their lanterns bobbing on the dark water, and he counted "
    "them one by one until the last of them was safely inside the harbour wall."
)
COPY_PROMPTS = (
    f"Repeat the following text exactly, word for word:\n\n{_TEXT}",
    f"Correct the spelling mistakes in this text:\n\n{_TEXT.replace('the', 'teh')}",
    f"Rewrite this text in the first person:\n\n{_TEXT}",
    f"Copy this paragraph twice:\n\n{_TEXT}",
    f"Summarise this text, quoting its sentences:\n\n{_TEXT}",
    f"Here is a paragraph:\n\n{_TEXT}\n\nWrite it out again.",
)


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters on /metrics: drafts, draft and accepted tokens, and accepted
    tokens per position (`position_0`, ...)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_num_") and sample.name.endswith("_total"):
                name = sample.name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
                if "position" in sample.labels:
                    name = f"position_{sample.labels['position']}"
                counters[name] = counters.get(name, 0) + sample.value
    return counters


def acceptance(before: dict, after: dict) -> str:
    """`12.0 % of 400 draft tokens accepted in 100 drafts; per position 0.30 0.15 ...`"""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts, tokens = delta.get("drafts", 0), delta.get("draft_tokens", 0)
    if not drafts:
        return "no drafts"
    per_position = sorted((int(k.split("_")[1]), v) for k, v in delta.items() if "position" in k)
    rates = " ".join(f"{v / drafts:.2f}" for _, v in per_position)
    return (
        f"{100 * delta.get('accepted_tokens', 0) / tokens:.1f} % of {tokens:.0f} draft tokens "
        f"accepted in {drafts:.0f} drafts; acceptance per position {rates}"
    )


def copy_dataset(out_dir: Path, num_prompts: int) -> Path:
    """The copy case's prompts as `vllm bench serve`'s custom JSONL, cycled to `num_prompts`."""
    path = out_dir / "copy-prompts.jsonl"
    prompts = itertools.islice(itertools.cycle(COPY_PROMPTS), num_prompts)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def case_args(case: str, num_prompts: int, out_dir: Path) -> tuple[int, int, tuple[str, ...]]:
    """(input length, output length, extra `vllm bench serve` flags) of a case."""
    if case == "copy":
        dataset = copy_dataset(out_dir, num_prompts)
        extra = ("--dataset-name", "custom", "--dataset-path", str(dataset),
                 "--custom-output-len", "128", "--temperature", "0")  # fmt: skip
        return 1, 128, extra
    input_len, output_len = (int(v) for v in case.split("x"))
    return input_len, output_len, ()
