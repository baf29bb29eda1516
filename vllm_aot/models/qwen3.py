"""Qwen3: the Llama layer with RMSNorm on each query and key head before rotary.

Config: refuses attention biases and `use_sliding_window=true`.
Parameters: Llama's, plus `q_norm` = `self_attn.q_norm` and `k_norm` = `self_attn.k_norm`
[head_dim], shared by all heads (replicated).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_aot.models import layers, llama, qwen2
from vllm_aot.models.config import ModelArch, decoder_arch_from_hf
from vllm_aot.models.family import Family, LayerParams, LayerSpec, Norm, Observe
from vllm_aot.models.layers import QKV


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    if config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported")
    qwen2.refuse_sliding_window(name, config)
    return decoder_arch_from_hf(name, config, family="qwen3")


def qk_norms(arch: ModelArch) -> tuple[Norm, Norm]:
    return (
        Norm("q_norm", "self_attn.q_norm", arch.head_dim),
        Norm("k_norm", "self_attn.k_norm", arch.head_dim),
    )


def layer_spec(arch: ModelArch, fmt: str) -> LayerSpec:
    return LayerSpec(llama.layer_spec(arch, fmt).params + qk_norms(arch))


def project_qkv(x: torch.Tensor, params: LayerParams, observe: Observe) -> QKV:
    """Llama's projection, then RMSNorm over each query and key head."""
    q, k, v = llama.project_qkv(x, params, observe)
    eps = params.arch.rms_norm_eps
    return QKV(
        layers.rms_norm(q, params.norm("q_norm"), eps),
        layers.rms_norm(k, params.norm("k_norm"), eps),
        v,
    )


decoder_layer = llama.pre_norm_layer(project=project_qkv)


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=decoder_layer,
)
