"""Fixed chat prompts for accuracy checks, and their token ids under a model's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Short and varied, so positions cover facts, lists, code, digits, another language and prose.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "List three primary colors.",
    "Write a Python function that returns the square of a number.",
    "What is 17 plus 25?",
    "Translate 'good morning' into Spanish.",
    "Define the word 'photosynthesis' in one sentence.",
    "Begin a short story about a lighthouse keeper who finds a message in a bottle.",
    "Compare cats and dogs as pets in two sentences.",
)


def chat_prompt_token_ids(
    tokenizer_dir: str | Path, prompts: Sequence[str] = CHAT_PROMPTS
) -> list[list[int]]:
    """Token ids of each prompt as a single user turn, ending with the assistant's header.

    Uses the tokenizer's own chat template with `add_generation_prompt=True`, so the ids are
    exactly what a chat client would send; one plain list of ints per prompt, in order.
    """
    from transformers import AutoTokenizer

    from vllm_aot.models.source import tokenizer_dir as tokenizer_of

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_of(tokenizer_dir))
    sequences = []
    for prompt in prompts:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding; 4.x returns the list of ids itself.
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        sequences.append([int(t) for t in ids])
    return sequences
