"""Tiny random-weight models (seeded) that reuse the default model's tokenizer; for tests."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Small, but with every feature of its family: GQA, tied or untied head, bias, q/k norm; MoE:
# 8 experts, top-2 (Qwen3-MoE's probabilities as they are, Mixtral's renormalised).
TINY_FAMILIES = {
    "llama": dict(cls="LlamaConfig", tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(cls="Qwen3Config", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig",
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        cls="MixtralConfig",
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
}


def make_tiny_model(
    out_dir: str | Path,
    *,
    family: str = "llama",
    tokenizer_dir: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    max_position_embeddings: int = 4096,
    spec: Mapping[str, Any] | None = None,
) -> Path:
    """Write an HF directory with random weights (seeded) and the tokenizer of `tokenizer_dir`.

    `spec` (the HF config class under `cls`, then its fields) defaults to `TINY_FAMILIES[family]`;
    a family being brought up passes its own until it joins `TINY_FAMILIES`.
    """
    import transformers

    spec = dict(TINY_FAMILIES[family] if spec is None else spec)
    config_cls = getattr(transformers, spec.pop("cls"))
    tokenizer_dir = Path(tokenizer_dir)
    vocab_size = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config = config_cls(**{**fields, **spec})  # the spec's fields win
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-default weights so logits spread out and greedy choices are well separated.
        for param in model.parameters():
            if param.dim() >= 2:  # linears, embeddings, stacked experts
                param.normal_(0.0, 0.08)
            else:  # norms and biases: away from exactly one/zero so mistakes show
                param.add_(torch.randn_like(param) * 0.1)
    out = Path(out_dir)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
