"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) and a sparse MoE block in every layer in
place of the MLP.

Config: Qwen3's refusals (attention biases, `use_sliding_window=true`), and what one layer
program cannot serve: dense layers among the sparse ones (`mlp_only_layers` non-empty,
`decoder_sparse_step` other than 1) and shared experts. Reads `num_experts` (transformers 5
writes `num_local_experts`), `num_experts_per_tok`, `moe_intermediate_size` and
`norm_topk_prob`; `intermediate_size` (the dense MLP's, used by no layer here) is not read.

Parameters per layer (HF names under `model.layers.{i}.`): Qwen3's attention and norms, and
`experts` = `mlp.gate` (the router) with `mlp.experts.{e}.gate_proj | up_proj` and `down_proj`,
or transformers 5's stacked `mlp.experts.gate_up_proj` and `down_proj` (`models/experts.py`).

Layer: Qwen3's attention, then x + experts(post_attention_layernorm(x)): softmax over the
router's logits, the top-k experts (their probabilities renormalised when `norm_topk_prob`),
each SwiGLU expert's output weighted by its probability (`LayerParams.experts`). Mixtral
reuses the MoE pieces.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from vllm_aot.models import llama, qwen2, qwen3
from vllm_aot.models.config import ModelArch, decoder_arch_from_hf, with_experts
from vllm_aot.models.experts import experts_of
from vllm_aot.models.family import Family, LayerParams, LayerSpec

EXPERTS_MODULES = ("mlp",)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def refuse(name: str, field: str, value: object, supported: str) -> NoReturn:
    raise ValueError(f"{name} with {field}={value!r} is not supported; supported: {supported}")


def parse_config(name: str, config: dict[str, Any]) -> ModelArch:
    if config.get("attention_bias"):
        raise ValueError(f"{name} with attention_bias=true is not supported")
    qwen2.refuse_sliding_window(name, config)
    if config.get("mlp_only_layers"):
        refuse(name, "mlp_only_layers", config["mlp_only_layers"], "[] (every layer sparse)")
    if int(config.get("decoder_sparse_step", 1)) != 1:
        refuse(name, "decoder_sparse_step", config["decoder_sparse_step"], "1")
    if config.get("shared_expert_intermediate_size"):
        value = config["shared_expert_intermediate_size"]
        refuse(name, "shared_expert_intermediate_size", value, "0 (no shared expert)")
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts <= 0:
        refuse(name, "num_experts", num_experts, "1 or more (Qwen3ForCausalLM is the dense one)")
    return with_experts(
        decoder_arch_from_hf(name, config, family="qwen3_moe"),
        num_experts=num_experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        expert_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )


def layer_spec(arch: ModelArch, fmt: str) -> LayerSpec:
    experts = experts_of(arch, fmt, modules=EXPERTS_MODULES, projections=PROJECTIONS)
    return LayerSpec((*llama.attention_params(arch, fmt), experts, *qwen3.qk_norms(arch)))


def sparse_moe(h: torch.Tensor, params: LayerParams) -> torch.Tensor:
    """The MoE block in the MLP's place: routing and the rank's experts, reduced."""
    return params.experts("experts", h)


decoder_layer = llama.pre_norm_layer(project=qwen3.project_qkv, mlp=sparse_moe)


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse_config=parse_config,
    layer_spec=layer_spec,
    decoder_layer=decoder_layer,
)
