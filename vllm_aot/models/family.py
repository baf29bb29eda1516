"""What an architecture family file states, and the view of a layer's tensors its maths reads.

A family (`models/llama.py`, `qwen2.py`, `qwen3.py`, registered in `models/registry.py`) gives:
- `parse_config`: an HF `config.json` dictionary -> `ModelArch`, refusing what it cannot run;
- `layer_spec`: one decoder layer's parameters (norms, `Linear`s: names, HF tensors, fusions,
  shards; a sparse MoE block's `Experts`) for an architecture and weight format;
  `models/weights.py` loads by it, and layer programs take the tensors in its order
  (`LayerSpec.tensor_names`);
- `decoder_layer`: the layer's maths composed from `models/layers.py`, over `LayerParams`,
  which reads a linear by its name (`params.linear("qkv_proj", h)`) whether it is stored whole
  or split into runs of parts in different formats (`LayerSpec.with_formats`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from vllm_aot.models import layers
from vllm_aot.models.config import ModelArch
from vllm_aot.models.experts import REFERENCE_EXPERTS, Experts, ExpertsKernel
from vllm_aot.models.experts import tensor_names as experts_tensor_names
from vllm_aot.models.formats import weight_format
from vllm_aot.models.linear import Linear, LinearKernel, Shard, split_by_format


@dataclass(frozen=True)
class Norm:
    """A vector parameter of a layer (a norm's weight, and a LayerNorm's bias), replicated on
    every rank."""

    name: str  # our parameter name, e.g. "q_norm"
    source: str  # HF module name under the layer prefix, e.g. "self_attn.q_norm"
    size: int
    has_bias: bool = False  # LayerNorm (encoders); RMSNorm has none


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer's parameters, in the order layer programs take their tensors."""

    params: tuple[Norm | Linear | Experts, ...]

    def linears(self) -> tuple[Linear, ...]:
        return tuple(p for p in self.params if isinstance(p, Linear))

    def runs(self, name: str) -> tuple[Linear, ...]:
        """Linear `name` as stored: itself, or the runs of parts it is split into, in order."""
        runs = tuple(p for p in self.linears() if name in (p.name, p.part_of))
        assert runs, f"no linear {name!r} in this layer"
        return runs

    def with_formats(self, format_of: Callable[[str], str]) -> LayerSpec:
        """The same layer with each linear (and experts) in format `format_of(its name)`, a
        fused linear whose parts `format_of` gives different formats split into runs of them
        (`linear.split_by_format`); ValueError for experts in a format they do not support."""

        def formatted(p: Norm | Linear | Experts) -> tuple[Norm | Linear | Experts, ...]:
            if isinstance(p, Experts):
                return (p.with_format(format_of(p.name)),)
            return split_by_format(p, format_of) if isinstance(p, Linear) else (p,)

        return LayerSpec(tuple(q for p in self.params for q in formatted(p)))

    def tensor_names(self) -> tuple[str, ...]:
        """`{param}.weight` per norm; per linear its format's stored tensors; then `.bias` for
        either when it has one; experts' `Experts.tensor_names`."""
        names: list[str] = []
        for p in self.params:
            if isinstance(p, Experts):
                names += p.tensor_names()
                continue
            stored = weight_format(p.format).tensor_names if isinstance(p, Linear) else ("weight",)
            bias = ("bias",) if p.has_bias else ()
            names += [f"{p.name}.{t}" for t in stored + bias]
        return tuple(names)

    def example_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors of the programs' shapes and dtypes (norms ones, the rest zeros), by name."""
        tensors: list[torch.Tensor] = []
        for p in self.params:
            if isinstance(p, Experts):
                tensors += p.example_tensors(dtype)
                continue
            if isinstance(p, Norm):
                tensors.append(torch.ones(p.size, dtype=dtype))
                tensors += [torch.zeros(p.size, dtype=dtype)] if p.has_bias else []
                continue
            tensors += weight_format(p.format).example(p.out_features, p.in_features)
            if p.has_bias:
                tensors.append(torch.zeros(p.out_features, dtype=dtype))
        return dict(zip(self.tensor_names(), tensors, strict=True))


def no_reduce(partial: torch.Tensor) -> torch.Tensor:
    """One rank: a row-parallel linear's output is already the whole sum."""
    return partial


@dataclass(frozen=True)
class LayerParams:
    """One layer's tensors inside a program, read by the family's maths by parameter name.

    `arch` is the rank's own (`ModelArch.for_rank`: its heads, KV heads and intermediate
    features, its experts); `reduce` sums a partial result over the tensor-parallel ranks
    (identity on one rank). A row-parallel linear's output is reduced inside `linear`, and a
    rank's experts' inside `experts`, so a family's maths reads the same on any number of ranks.
    """

    arch: ModelArch
    spec: LayerSpec
    kernels: Mapping[str, LinearKernel]  # weight format name -> its kernel on this CPU
    tensors: Mapping[str, torch.Tensor]  # `LayerSpec.tensor_names` -> tensor
    reduce: Callable[[torch.Tensor], torch.Tensor] = no_reduce
    experts_kernel: ExpertsKernel = REFERENCE_EXPERTS  # a rank's experts, on this CPU

    def norm(self, name: str) -> torch.Tensor:
        return self.tensors[f"{name}.weight"]

    def norm_bias(self, name: str) -> torch.Tensor:
        return self.tensors[f"{name}.bias"]

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Linear `name` applied to x [..., in] -> [..., out], through its format's kernel (a
        split one's runs each through theirs, their outputs concatenated); a row-parallel one's
        partial sums reduced over the ranks."""
        runs = self.spec.runs(name)
        outputs = [self._apply(run, x) for run in runs]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return self.reduce(out) if runs[0].shard is Shard.ROW else out

    def _apply(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        names = weight_format(linear.format).tensor_names
        stored = [self.tensors[f"{linear.name}.{t}"] for t in names]
        bias = self.tensors[f"{linear.name}.bias"] if linear.has_bias else None
        return self.kernels[linear.format].apply(x, *stored, bias)

    def experts(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Sparse MoE block `name` over x [tokens, hidden] -> [tokens, hidden]: every token
        routed in float32 (`layers.route`, the router's logits included, where HF computes
        them in the model's dtype and its rounding makes near-equal experts tie), then the
        rank's experts over the tokens routed to them (`experts_kernel`), whose partial sums
        are reduced over the ranks."""
        router, w13, w2, first_expert = (self.tensors[n] for n in experts_tensor_names(name))
        logits = F.linear(x.float(), router.float())
        routing = layers.route(
            logits, self.arch.num_experts_per_tok, renormalize=self.arch.norm_topk_prob
        )
        out = self.experts_kernel.apply(x, routing.ids, routing.weights, w13, w2, first_expert)
        return self.reduce(out)


# (q [tokens, heads, head_dim], k_new, v_new [tokens, kv_heads, head_dim]) -> [tokens, heads *
# head_dim]: attention of the step's tokens over the cache and themselves (prefill or decode).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Sees a sub-layer output under its HF module name ("input_layernorm", "self_attn",
# "post_attention_layernorm", "mlp"); programs pass a no-op, the eager instrumented layer records.
Observe = Callable[[str, torch.Tensor], None]


class DecoderLayer(Protocol):
    """A layer's maths (an encoder's too: it ignores `rope`, its `attend` is bidirectional and
    the K/V it returns are dropped, there being no cache)."""

    def __call__(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        *,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [tokens, head_dim]
        attend: Attend,
        params: LayerParams,
        observe: Observe,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (hidden [tokens, hidden], k_new, v_new [tokens, kv_heads, head_dim])."""
        ...


class EmbedStage(Protocol):
    def __call__(
        self,
        arch: ModelArch,
        word_rows: torch.Tensor,  # [tokens, hidden]: the embedding's rows of the token ids
        tensors: Mapping[str, torch.Tensor],  # `Family.embedding_extras` by HF name
        positions: torch.Tensor,  # [tokens] int64, each token's position in its sequence
        token_types: torch.Tensor,  # [tokens] int64 segment ids
    ) -> torch.Tensor:
        """-> the first layer's input [tokens, hidden] (an encoder's embedding stage)."""
        ...


@dataclass(frozen=True)
class Family:
    """One architecture family (see the module docstring), with HF's tensor names (decoder-only
    ones by default; an encoder names its own, its embedding stage and no final norm)."""

    name: str  # `ModelArch.family`
    architectures: tuple[str, ...]  # the HF `architectures` names it serves
    parse_config: Callable[[str, dict[str, Any]], ModelArch]  # (HF name, config) -> arch
    layer_spec: Callable[[ModelArch, str], LayerSpec]  # (arch, weight format name) -> spec
    decoder_layer: DecoderLayer
    layer_prefix: str = "model.layers.{index}."
    embedding: str = "model.embed_tokens"
    final_norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    embedding_extras: tuple[str, ...] = ()  # dense tensors `embed` reads (HF names)
    embed: EmbedStage | None = None  # None: the word embedding's rows are the layers' input
    is_encoder: bool = False  # its architectures parse to `ModelArch.is_encoder`

    def head_source(self, arch: ModelArch, has_head: bool) -> str:
        """The HF module the LM head's rows come from: its own, or the embedding's when the
        architecture ties them or the checkpoint has no head (`has_head`)."""
        return self.lm_head if has_head and not arch.tie_word_embeddings else self.embedding
