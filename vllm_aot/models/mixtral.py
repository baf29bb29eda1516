"""Mixtral: Mistral's attention (its sliding window kept, as Mistral's) and a sparse MoE block
in every layer in place of the MLP, its top-k probabilities always renormalised.

Config: Llama's refusals (attention biases, MLP biases, activations other than SiLU); reads
`num_local_experts`, `num_experts_per_tok` and `intermediate_size` (each expert's);
`router_jitter_noise` acts in training only.

Parameters per layer (HF names under `model.layers.{i}.`): Llama's attention and norms, and
`experts` = `block_sparse_moe.gate` (the router) with `block_sparse_moe.experts.{e}.w1 | w3`
(gate, up) and `w2` (down), or transformers 5's stacked `mlp.experts.gate_up_proj` and
`down_proj` beside `mlp.gate` (`models/experts.py`).

Layer: Llama's attention, then Qwen3-MoE's sparse MoE block (`qwen3_moe.sparse_moe`).
"""

from __future__ import annotations

from typing import Any

from vllm_aot.models import llama, qwen3_moe
from vllm_aot.models.config import ModelArch, decoder_arch_from_hf, with_experts
from vllm_aot.models.experts import experts_of
from vllm_aot.models.family import Family, LayerSpec

EXPERTS_MODULES = ("block_sparse_moe", "mlp")
PROJECTIONS = ("w1", "w3", "w2")


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    if config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported")
    arch = decoder_arch_from_hf(
        name, config, family="mixtral", sliding_window=config.get("sliding_window")
    )
    return with_experts(
        arch,
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        expert_intermediate_size=arch.intermediate_size,
        norm_topk_prob=True,
    )


def layer_spec(arch: ModelArch, fmt: str) -> LayerSpec:
    experts = experts_of(arch, fmt, modules=EXPERTS_MODULES, projections=PROJECTIONS)
    return LayerSpec((*llama.attention_params(arch, fmt), experts))


decoder_layer = llama.pre_norm_layer(mlp=qwen3_moe.sparse_moe)


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=decoder_layer,
)
