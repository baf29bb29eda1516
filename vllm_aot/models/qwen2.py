"""Qwen2: the Llama layer with a bias on the q, k and v projections.

Config: refuses `use_sliding_window=true` (Qwen2 configs carry a window they do not use unless
that flag is set), and attention biases are always there (`attention_bias` is not read).
Parameters: Llama's, with `qkv_proj.bias` = `self_attn.q_proj | k_proj | v_proj` biases, split
like the weight's rows. Layer: Llama's.
"""

from __future__ import annotations

from typing import Any

from vllm_aot.models import llama
from vllm_aot.models.config import ModelArch, decoder_arch_from_hf
from vllm_aot.models.family import Family, LayerSpec


def refuse_sliding_window(name: str, config: dict[str, Any]) -> None:
    if config.get("use_sliding_window"):
        raise ValueError(f"{name} with use_sliding_window=true is not supported")


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    refuse_sliding_window(name, config)
    return decoder_arch_from_hf(name, config, family="qwen2")


def layer_spec(arch: ModelArch, fmt: str) -> LayerSpec:
    return llama.layer_spec(arch, fmt, has_qkv_bias=True)


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=llama.decoder_layer,
)
