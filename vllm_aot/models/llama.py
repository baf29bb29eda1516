"""Llama and Mistral: pre-norm decoder layers of grouped-query attention and a SwiGLU MLP.

Config: HF's Llama fields; attention and MLP biases are refused, Mistral's sliding window is kept
(the runtime refuses a max_model_len beyond it), Llama has none.

Parameters per layer (HF names under `model.layers.{i}.`):
- `input_layernorm`, `post_attention_layernorm`: RMSNorm weights [hidden];
- `qkv_proj` = `self_attn.q_proj | k_proj | v_proj`, column-parallel [q + 2 * kv, hidden];
- `o_proj` = `self_attn.o_proj`, row-parallel [hidden, q];
- `gate_up_proj` = `mlp.gate_proj | up_proj`, column-parallel [2 * intermediate, hidden];
- `down_proj` = `mlp.down_proj`, row-parallel [hidden, intermediate].
A fused linear whose parts are stored in different formats (a GGUF's v in more bits than q and k)
is split into runs of them (`linear.split_by_format`); `params.linear` reads it as one.

Layer: x + o_proj(attention(rotary(q), rotary(k), v)) over the normed input, then
x + down_proj(silu(gate) * up) over the normed result. Qwen2 and Qwen3 reuse these pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_aot.models import layers  # through the module: a fault planted in one (tests) reaches all
from vllm_aot.models.config import ModelArch, decoder_arch_from_hf
from vllm_aot.models.family import (
    Attend,
    DecoderLayer,
    Family,
    LayerParams,
    LayerSpec,
    Norm,
    Observe,
)
from vllm_aot.models.layers import QKV
from vllm_aot.models.linear import Linear, Shard


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    if config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported")
    window = config.get("sliding_window") if name == "MistralForCausalLM" else None
    return decoder_arch_from_hf(name, config, family="llama", sliding_window=window)


def attention_linears(
    arch: ModelArch, fmt: str, *, has_qkv_bias: bool = False
) -> tuple[Linear, Linear]:
    """q|k|v (column-parallel: each rank its heads of each) and the output projection (row)."""
    qkv = Linear(
        name="qkv_proj",
        in_features=arch.hidden_size,
        out_parts=(arch.q_size, arch.kv_size, arch.kv_size),
        sources=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        format=fmt,
        shard=Shard.COLUMN,
        has_bias=has_qkv_bias,
    )
    o = Linear(
        name="o_proj",
        in_features=arch.q_size,
        out_parts=(arch.hidden_size,),
        sources=("self_attn.o_proj",),
        format=fmt,
        shard=Shard.ROW,
    )
    return qkv, o


def mlp_linears(arch: ModelArch, fmt: str) -> tuple[Linear, Linear]:
    """gate|up (column-parallel) and down (row-parallel): each rank its slice of intermediate."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    gate_up = Linear(
        name="gate_up_proj",
        in_features=hidden,
        out_parts=(inter, inter),
        sources=("mlp.gate_proj", "mlp.up_proj"),
        format=fmt,
        shard=Shard.COLUMN,
    )
    down = Linear(
        name="down_proj",
        in_features=inter,
        out_parts=(hidden,),
        sources=("mlp.down_proj",),
        format=fmt,
        shard=Shard.ROW,
    )
    return gate_up, down


def attention_params(
    arch: ModelArch, fmt: str, *, has_qkv_bias: bool = False
) -> tuple[Norm, Linear, Linear, Norm]:
    """The input norm, the attention's linears and the norm after attention (before the MLP,
    or whatever block takes its place)."""
    hidden = arch.hidden_size
    return (
        Norm("input_layernorm", "input_layernorm", hidden),
        *attention_linears(arch, fmt, has_qkv_bias=has_qkv_bias),
        Norm("post_attention_layernorm", "post_attention_layernorm", hidden),
    )


def layer_spec(arch: ModelArch, fmt: str, *, has_qkv_bias: bool = False) -> LayerSpec:
    attention = attention_params(arch, fmt, has_qkv_bias=has_qkv_bias)
    return LayerSpec((*attention, *mlp_linears(arch, fmt)))


def project_qkv(x: torch.Tensor, params: LayerParams, observe: Observe) -> QKV:
    """Input norm, then the fused q|k|v projection split into heads (before rotary)."""
    arch = params.arch
    h = layers.rms_norm(x, params.norm("input_layernorm"), arch.rms_norm_eps)
    observe("input_layernorm", h)
    qkv = params.linear("qkv_proj", h)
    return layers.split_heads(qkv, arch.num_heads, arch.num_kv_heads, arch.head_dim)


def mlp(h: torch.Tensor, params: LayerParams) -> torch.Tensor:
    """SwiGLU: down(silu(gate(h)) * up(h)), gate and up as one fused projection."""
    return params.linear("down_proj", layers.swiglu(params.linear("gate_up_proj", h)))


def attend_and_mlp(
    x: torch.Tensor,
    qkv: QKV,
    *,
    rope: tuple[torch.Tensor, torch.Tensor],
    attend: Attend,
    params: LayerParams,
    observe: Observe,
    mlp: Callable[[torch.Tensor, LayerParams], torch.Tensor] = mlp,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary on q and k, attention, output projection and residual, then the MLP block (or
    the block `mlp` in its place: an MoE layer's experts), observed as "mlp"."""
    q, k = layers.apply_rotary(qkv.q, *rope), layers.apply_rotary(qkv.k, *rope)
    attn = params.linear("o_proj", attend(q, k, qkv.v))
    observe("self_attn", attn)
    x = x + attn
    h = layers.rms_norm(x, params.norm("post_attention_layernorm"), params.arch.rms_norm_eps)
    observe("post_attention_layernorm", h)
    out = mlp(h, params)
    observe("mlp", out)
    return x + out, k, qkv.v


def pre_norm_layer(
    project: Callable[[torch.Tensor, LayerParams, Observe], QKV] = project_qkv,
    mlp: Callable[[torch.Tensor, LayerParams], torch.Tensor] = mlp,
) -> DecoderLayer:
    """The pre-norm decoder layer with its q/k/v projection (`project`: Qwen3's adds q/k norms)
    and its MLP block (`mlp`: a MoE family's experts) given; every Llama-like family is one."""

    def decoder_layer(
        x: torch.Tensor,
        *,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
        params: LayerParams,
        observe: Observe,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = project(x, params, observe)
        return attend_and_mlp(
            x, qkv, rope=rope, attend=attend, params=params, observe=observe, mlp=mlp
        )

    return decoder_layer


decoder_layer = pre_norm_layer()


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=decoder_layer,
)
