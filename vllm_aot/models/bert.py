"""BERT encoders (sentence-transformers' checkpoints such as all-MiniLM-L6-v2): post-norm layers
of bidirectional multi-head attention and a GELU MLP, absolute position and token-type
embeddings, no KV cache (`ModelArch.is_encoder`).

Config: HF's `BertModel` fields; `position_embedding_type` other than absolute and activations
other than (exact) GELU are refused. `rms_norm_eps` holds `layer_norm_eps`.

Embedding stage (HF names under `embeddings.`, run once a step on the host): word + position +
token-type rows, then LayerNorm (`LayerNorm.weight`, `.bias`).

Parameters per layer (HF names under `encoder.layer.{i}.`):
- `qkv_proj` = `attention.self.query | key | value` with biases, column-parallel [3 * hidden];
- `o_proj` = `attention.output.dense` with bias, row-parallel;
- `attention_norm` = `attention.output.LayerNorm` (weight and bias);
- `up_proj` = `intermediate.dense` with bias, column-parallel [intermediate, hidden];
- `down_proj` = `output.dense` with bias, row-parallel [hidden, intermediate];
- `output_norm` = `output.LayerNorm`.

Layer: x = LN(x + o_proj(attention(q, k, v))), then LN(x + down_proj(gelu(up_proj(x)))).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from vllm_aot.models import layers
from vllm_aot.models.config import ModelArch, RopeSpec
from vllm_aot.models.family import Attend, Family, LayerParams, LayerSpec, Norm, Observe
from vllm_aot.models.linear import Linear, Shard

POSITIONS = "embeddings.position_embeddings.weight"
TOKEN_TYPES = "embeddings.token_type_embeddings.weight"
EMBED_NORM = "embeddings.LayerNorm"


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    positions = config.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ValueError(
            f"{name} with position_embedding_type={positions!r} is not supported; "
            "supported: absolute"
        )
    activation = config.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ValueError(f"{name} with hidden_act={activation!r} is not supported; supported: gelu")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = hidden // num_heads
    return ModelArch(
        architecture=name,
        family="bert",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        rope=RopeSpec(theta=10000.0, head_dim=head_dim),  # unused: absolute positions
        max_position_embeddings=int(config.get("max_position_embeddings", 512)),
        tie_word_embeddings=False,
        is_encoder=True,
        type_vocab_size=int(config.get("type_vocab_size", 2)),
    )


def _linear(name: str, source: str, *, in_features: int, out: int, fmt: str, shard: Shard):
    return Linear(
        name=name,
        in_features=in_features,
        out_parts=(out,),
        sources=(source,),
        format=fmt,
        shard=shard,
        has_bias=True,
    )


def layer_spec(arch: ModelArch, fmt: str) -> LayerSpec:
    hidden, inter = arch.hidden_size, arch.intermediate_size
    qkv = Linear(
        name="qkv_proj",
        in_features=hidden,
        out_parts=(arch.q_size, arch.kv_size, arch.kv_size),
        sources=("attention.self.query", "attention.self.key", "attention.self.value"),
        format=fmt,
        shard=Shard.COLUMN,
        has_bias=True,
    )
    return LayerSpec(
        (
            qkv,
            _linear(
                "o_proj",
                "attention.output.dense",
                in_features=hidden,
                out=hidden,
                fmt=fmt,
                shard=Shard.ROW,
            ),
            Norm("attention_norm", "attention.output.LayerNorm", hidden, has_bias=True),
            _linear(
                "up_proj",
                "intermediate.dense",
                in_features=hidden,
                out=inter,
                fmt=fmt,
                shard=Shard.COLUMN,
            ),
            _linear(
                "down_proj",
                "output.dense",
                in_features=inter,
                out=hidden,
                fmt=fmt,
                shard=Shard.ROW,
            ),
            Norm("output_norm", "output.LayerNorm", hidden, has_bias=True),
        )
    )


def _norm(x: torch.Tensor, params: LayerParams, name: str) -> torch.Tensor:
    return layers.layer_norm(x, params.norm(name), params.norm_bias(name), params.arch.rms_norm_eps)


def encoder_layer(
    x: torch.Tensor,
    *,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    attend: Attend,
    params: LayerParams,
    observe: Observe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's maths (`family.DecoderLayer`; `rope` unused)."""
    arch = params.arch
    qkv = params.linear("qkv_proj", x)
    q, k, v = layers.split_heads(qkv, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    attn = params.linear("o_proj", attend(q, k, v))
    observe("attention", attn)
    x = _norm(x + attn, params, "attention_norm")
    out = params.linear("down_proj", F.gelu(params.linear("up_proj", x)))
    observe("output", out)
    return _norm(x + out, params, "output_norm"), k, v


def embed(
    arch: ModelArch,
    word_rows: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    token_types: torch.Tensor,
) -> torch.Tensor:
    """Word + position + token-type embeddings, then LayerNorm: [tokens, hidden]."""
    x = word_rows + tensors[POSITIONS][positions] + tensors[TOKEN_TYPES][token_types]
    weight, bias = tensors[f"{EMBED_NORM}.weight"], tensors[f"{EMBED_NORM}.bias"]
    return layers.layer_norm(x, weight, bias, arch.rms_norm_eps)


FAMILY = Family(
    name="bert",
    architectures=("BertModel",),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=encoder_layer,
    layer_prefix="encoder.layer.{index}.",
    embedding="embeddings.word_embeddings",
    final_norm=None,
    embedding_extras=(POSITIONS, TOKEN_TYPES, f"{EMBED_NORM}.weight", f"{EMBED_NORM}.bias"),
    embed=embed,
    is_encoder=True,
)
