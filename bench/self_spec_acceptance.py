"""Would a self-speculative draft pay on SmolLM2? Its acceptance per position, and its cost.

    .venv/bin/python bench/self_spec_acceptance.py [--layers 4,8,12,16] [--tokens 96]

A self-speculative draft is the target's first N layers with its final norm and LM head. For
greedy decoding its draft at position t + j is accepted when it and every earlier draft of the
step equal the target's token; while drafts are accepted the draft reads the same context as the
target, so the chance that a step accepts j + 1 drafts is the share of positions t whose next
j + 1 early-exit argmaxes all equal the target's (taught the target's own greedy text). Measured
here on the fixed chat prompts (the eager runtime, float32, the bundled model's weights), and set
against the cost of a draft token in weight bytes read (N layers plus the head, against a full
step's 30 layers plus the head, from the bundled GGUF's formats): the expected tokens a step
gains for what its drafts and the verify cost.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from vllm_aot.accuracy.prompts import chat_prompt_token_ids
from vllm_aot.loading.startup import load_model
from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk, RowSampling
from vllm_aot.runtime.sampler import GREEDY

MAX_DRAFTS = 4


def early_exit_tokens(model, sequence: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """Argmax after each of `layers` (final norm and head applied) at every position."""
    captured: dict[int, torch.Tensor] = {}
    wanted = {f"model.layers.{n - 1}": n for n in layers}

    def tap(*, name, tensor, positions):
        if name in wanted:
            captured[wanted[name]] = tensor[: len(positions)].clone()
        return tensor

    blocks = list(range(1, len(sequence) // model.config.block_size + 2))
    with model.tapped(tap):
        model.prefill_logits(PrefillChunk(sequence, 0, blocks))
    rows = max(model.config.head_row_buckets)
    out = {}
    for n, hidden in captured.items():
        tokens = []
        for start in range(0, hidden.shape[0], rows):
            part = hidden[start : start + rows]
            padded = torch.zeros(rows, part.shape[1], dtype=part.dtype)
            padded[: part.shape[0]] = part
            sampled = model.sample(padded, [RowSampling(GREEDY, 0, 0)] * part.shape[0])
            tokens.append(sampled.tokens)
        out[n] = torch.cat(tokens)
    return out


def acceptance(agree: torch.Tensor) -> list[float]:
    """P(the first j + 1 drafts of a step are all accepted), j = 0 .. MAX_DRAFTS - 1."""
    rates = []
    run = torch.ones_like(agree)
    for j in range(MAX_DRAFTS):
        shifted = torch.zeros_like(agree)
        shifted[: len(agree) - j] = agree[j:]
        run = run & shifted
        rates.append(float(run[: len(agree) - MAX_DRAFTS].float().mean()))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,12,16,24")
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    layers = [int(n) for n in args.layers.split(",")]
    model_dir = prepare_default_model()
    config = RuntimeConfig(max_num_seqs=8, max_model_len=512, dtype="float32", backend="eager")
    model, _ = load_model(model_dir, config, show_progress=False)
    agree: dict[int, list[torch.Tensor]] = {n: [] for n in layers}
    for prompt in chat_prompt_token_ids(model_dir):
        request = GenerationRequest(prompt, max_tokens=args.tokens, ignore_eos=True)
        generated = Generator(model).generate([request])[0].token_ids
        sequence = prompt + generated
        drafts = early_exit_tokens(model, sequence, layers)
        # Position p's logits predict token p + 1: compare over the generated continuation.
        for n in layers:
            predicted = drafts[n][len(prompt) - 1 : len(sequence) - 1]
            agree[n].append(predicted == torch.tensor(generated))
    arch = model.arch
    layer_bytes = _layer_bytes(arch)
    head_bytes = arch.vocab_size * arch.hidden_size * 34 / 32  # Q8_0
    step = arch.num_layers * layer_bytes + head_bytes
    table = Table("draft layers", *(f"accept pos {j}" for j in range(MAX_DRAFTS)))
    table.add_column("draft token / full step (bytes)")
    table.add_column("best k: tokens a step / cost")
    for n in layers:
        rates = acceptance(torch.cat(agree[n]))
        draft_cost = (n * layer_bytes + head_bytes) / step
        best = max(
            ((1 + sum(rates[:k])) / (1 + k * draft_cost), k) for k in range(1, MAX_DRAFTS + 1)
        )
        table.add_row(
            str(n),
            *(f"{r:.2f}" for r in rates),
            f"{draft_cost:.2f}",
            f"k={best[1]}: {best[0]:.2f}x",
        )
    Console(width=160).print(table)
    print(
        "tokens a step / cost: (1 + expected accepted drafts) / (1 + k draft tokens' bytes), "
        "the verify step counted as one full step (its k + 1 rows read the weights once)"
    )


def _layer_bytes(arch) -> float:
    """One decoder layer's weights in the bundled GGUF's Q4_1 (20 bytes per 32 weights)."""
    kv = arch.num_kv_heads * arch.head_dim
    q = arch.num_heads * arch.head_dim
    weights = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size
    weights += 3 * arch.hidden_size * arch.intermediate_size
    return weights * 20 / 32


if __name__ == "__main__":
    main()
