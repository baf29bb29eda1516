"""Architecture name -> what our Llama-family implementation must switch on for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_aot.models.config import ModelArch, load_hf_config, rope_from_hf


@dataclass(frozen=True)
class Family:
    """How an HF architecture differs from plain Llama."""

    has_qkv_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    has_qk_norm: bool = False
    honours_sliding_window: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(honours_sliding_window=True),
    "Qwen2ForCausalLM": Family(has_qkv_bias=True),
    "Qwen3ForCausalLM": Family(has_qk_norm=True),
}


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """Build a `ModelArch`; raises ValueError naming the supported architectures."""
    names = config.get("architectures") or []
    name = next((n for n in names if n in FAMILIES), None)
    if name is None:
        raise ValueError(
            f"architecture {names or config.get('model_type')!r} is not supported by vllm-aot; "
            f"supported: {', '.join(supported_architectures())}"
        )
    family = FAMILIES[name]
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{name} with hidden_act={activation!r} is not supported; supported: silu")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    if not name.startswith("Qwen2") and config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported")
    if config.get("mlp_bias"):
        raise ValueError(f"{name} with mlp_bias=true is not supported")
    window = config.get("sliding_window") if family.honours_sliding_window else None
    if name.startswith("Qwen") and config.get("use_sliding_window"):
        raise ValueError(f"{name} with use_sliding_window=true is not supported")
    return ModelArch(
        architecture=name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(config, head_dim),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        has_qkv_bias=family.has_qkv_bias,
        has_qk_norm=family.has_qk_norm,
        sliding_window=int(window) if window else None,
    )


def load_arch(model_dir: str | Path) -> ModelArch:
    return arch_from_hf_config(load_hf_config(model_dir))
