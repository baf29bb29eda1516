"""What a model *is*, reduced to the numbers a static-shape implementation needs.

`ModelArch` is built from an HF `config.json` dictionary (transformers 4 and 5 layouts) and is the
only description of a model that `models/` and `runtime/` pass around.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding variant; `inv_freq()` gives the per-pair frequencies."""

    theta: float
    head_dim: int
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32 frequencies, after any scaling."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "llama3":
            return self._llama3_scaled(inv_freq)
        return inv_freq

    def _llama3_scaled(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


# `ModelArch`'s mixture-of-experts fields (left out of a dense model's digest).
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "expert_parallel_size")


@dataclass(frozen=True)
class ModelArch:
    """Architecture of a model, as our implementation needs it: a decoder (causal attention,
    rotary positions, a KV cache) or, with `is_encoder`, an encoder (bidirectional attention,
    absolute position and token-type embeddings, no KV cache; `rope` unused).

    A mixture-of-experts decoder (`num_experts` > 0) has a sparse MoE block in every layer in
    place of the MLP: `intermediate_size` is then each expert's, a router picks
    `num_experts_per_tok` experts per token (their softmax probabilities renormalised to sum to
    one when `norm_topk_prob`), and `expert_parallel_size` is how many ranks the experts split
    over (1 but in a rank's share, `for_rank`).
    """

    architecture: str  # the HF name, e.g. "MistralForCausalLM"
    family: str  # the registered family whose layer maths and parameters it uses, e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float  # the layers' norm epsilon (LayerNorm's for encoders)
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    is_encoder: bool = False
    type_vocab_size: int = 0  # token-type (segment) embeddings of an encoder
    num_experts: int = 0  # experts of each layer's MoE block (the router's outputs); 0: dense
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to one
    expert_parallel_size: int = 1  # ranks the experts split over (each holds a contiguous range)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            "query heads must group evenly over KV heads"
        )
        assert self.num_experts % self.expert_parallel_size == 0, (
            "experts must split evenly over the expert-parallel ranks"
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_experts_per_rank(self) -> int:
        """The experts one rank holds (all of them unless expert-parallel)."""
        return self.num_experts // self.expert_parallel_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def for_rank(self, tensor_parallel_size: int, *, expert_parallel: bool = False) -> ModelArch:
        """One of `tensor_parallel_size` ranks' share of every layer: its query and KV heads and
        intermediate features (the hidden size and vocabulary stay whole: the embedding and head
        split by `Shard.VOCAB` rows). An MoE layer's experts split by intermediate features
        like an MLP, or, with `expert_parallel` (vLLM's --enable-expert-parallel), whole experts
        over the same ranks (`expert_parallel_size`; attention stays tensor-parallel). Raises
        ValueError naming what does not split evenly."""
        tp = tensor_parallel_size
        if tp == 1:
            return self
        if self.is_encoder:
            raise ValueError(f"{self.architecture}: encoders run on one rank (tensor parallel 1)")
        if expert_parallel and not self.is_moe:
            raise ValueError(f"{self.architecture} has no experts to split (expert parallel)")
        split = ("experts", self.num_experts) if expert_parallel else None
        for what, count in (
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            split or ("intermediate size", self.intermediate_size),
        ):
            if count % tp:
                raise ValueError(
                    f"{self.architecture}: {what} ({count}) do not split evenly over "
                    f"tensor-parallel size {tp}"
                )
        return replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=self.num_kv_heads // tp,
            intermediate_size=self.intermediate_size // (1 if expert_parallel else tp),
            expert_parallel_size=tp if expert_parallel else 1,
        )

    def digest_fields(self) -> dict[str, Any]:
        """The fields that change a compiled program (for cache keys): everything but the HF name
        (the family stays: it decides the layer's maths and parameters)."""
        fields = dict(self.__dict__)
        fields.pop("architecture")
        fields["rope"] = dict(self.rope.__dict__)
        if not self.is_moe:  # dense models keep the digests they had before MoE fields existed
            for name in MOE_FIELDS:
                fields.pop(name)
        return fields


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not an HF model directory (no config.json)")
    return json.loads(path.read_text())


def rope_from_hf(config: dict[str, Any], head_dim: int) -> RopeSpec:
    """Read transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported; supported: default, linear, llama3")
    return RopeSpec(
        theta=theta,
        head_dim=head_dim,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def decoder_arch_from_hf(
    name: str, config: dict[str, Any], *, family: str, sliding_window: int | None = None
) -> ModelArch:
    """The fields every Llama-like decoder reads alike; refuses activations other than SiLU and
    MLP biases (families refuse their own extras before calling this)."""
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{name} with hidden_act={activation!r} is not supported; supported: silu")
    if config.get("mlp_bias"):
        raise ValueError(f"{name} with mlp_bias=true is not supported")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    return ModelArch(
        architecture=name,
        family=family,
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
        sliding_window=int(sliding_window) if sliding_window else None,
    )


def with_experts(
    arch: ModelArch,
    *,
    num_experts: int,
    num_experts_per_tok: int,
    expert_intermediate_size: int,
    norm_topk_prob: bool,
) -> ModelArch:
    """`arch` (`decoder_arch_from_hf`'s) with a sparse MoE block in every layer, its experts'
    intermediate size in `intermediate_size`. Raises ValueError for a top-k outside
    1..num_experts."""
    if not 0 < num_experts_per_tok <= num_experts:
        raise ValueError(
            f"{arch.architecture} with num_experts_per_tok={num_experts_per_tok} and "
            f"{num_experts} experts is not supported; supported: 1 to the number of experts"
        )
    return replace(
        arch,
        intermediate_size=expert_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
    )
