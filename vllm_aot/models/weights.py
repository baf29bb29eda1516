"""A checkpoint (`models/checkpoints.py`) -> our fused parameters in their weight formats, loaded
once and shared by every program."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vllm_aot.models.checkpoints import Checkpoint, open_checkpoint
from vllm_aot.models.config import ModelArch
from vllm_aot.models.experts import Experts, load_experts
from vllm_aot.models.family import LayerSpec, Norm
from vllm_aot.models.formats import dense_format, take_rows, weight_format
from vllm_aot.models.linear import (
    EMBEDDING,
    LM_HEAD,
    SINGLE_RANK,
    Linear,
    Rank,
    Shard,
    shard_bias,
)
from vllm_aot.models.registry import family_of

# One layer's tensors by `LayerSpec.tensor_names`, in that order (the layer programs' inputs).
LayerWeights = dict[str, torch.Tensor]
# Linear name -> weight format name (`RuntimeConfig.linear_format`).
FormatOf = Callable[[str], str]


class StoredWeight(NamedTuple):
    """A [rows, in] weight as its format stores it."""

    format: str
    tensors: tuple[torch.Tensor, ...]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [n] as [n, in] of `dtype` (an embedding lookup)."""
        fmt = weight_format(self.format)
        if len(self.tensors) == 1 and self.tensors[0].dtype == dtype:  # dense: no copy of rows
            return F.embedding(ids, self.tensors[0])
        return take_rows(fmt, self.tensors, ids).to(dtype)


class ModelWeights(NamedTuple):
    embed: StoredWeight  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]; [0] for an encoder (none)
    lm_head: StoredWeight  # [vocab, hidden]; the embedding itself when tied (same format)
    kv_scales: tuple[tuple[float, float], ...] = ()  # per layer (k, v): `kv_scales`; () = 1.0
    embed_extras: dict[str, torch.Tensor] = {}  # noqa: RUF012 -- `Family.embedding_extras`
    rank: Rank = SINGLE_RANK  # the tensor-parallel rank whose slices these are

    def vocab_range(self) -> tuple[int, int]:
        """The token ids [first, end) whose embedding rows this rank holds (`Shard.VOCAB`)."""
        per_rank = self.embed.tensors[0].shape[0]
        return self.rank.index * per_rank, (self.rank.index + 1) * per_rank

    def num_bytes(self) -> int:
        tensors = [*self.embed.tensors, self.final_norm, *self.lm_head.tensors]
        tensors += self.embed_extras.values()
        tensors += [t for layer in self.layers for t in layer.values()]
        unique = {t.data_ptr(): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())


def _load_layer(
    checkpoint: Checkpoint, spec: LayerSpec, prefix: str, dtype: torch.dtype, rank: Rank
) -> LayerWeights:
    tensors: list[torch.Tensor] = []
    for param in spec.params:
        if isinstance(param, Experts):
            tensors += load_experts(checkpoint, param, prefix, dtype, rank)
            continue
        if isinstance(param, Norm):
            parts = ("weight", "bias") if param.has_bias else ("weight",)
            for part in parts:
                norm = checkpoint.dense(f"{prefix}{param.source}.{part}")
                tensors.append(norm.to(dtype).contiguous())
            continue
        names = [f"{prefix}{source}.weight" for source in param.sources]
        tensors += checkpoint.stored(param, names, rank)
        if param.has_bias:
            parts = [checkpoint.dense(f"{prefix}{source}.bias") for source in param.sources]
            bias = shard_bias(param, torch.cat(parts), rank)
            tensors.append(bias.to(dtype).contiguous())
    return dict(zip(spec.tensor_names(), tensors, strict=True))


def _load_vocab_rows(
    checkpoint: Checkpoint, arch: ModelArch, source: str, fmt: str, rank: Rank
) -> StoredWeight:
    """An embedding or LM head [vocab, hidden]: vocabulary-parallel, in weight format `fmt`."""
    rows = Linear(
        name=source,
        in_features=arch.hidden_size,
        out_parts=(arch.vocab_size,),
        sources=(source,),
        format=fmt,
        shard=Shard.VOCAB,
    )
    return StoredWeight(fmt, checkpoint.stored(rows, [f"{source}.weight"], rank))


def kv_scales(
    checkpoint: Checkpoint, layer_prefix: str, num_layers: int
) -> tuple[tuple[float, float], ...]:
    """Per layer (k_scale, v_scale) of an FP8 KV cache, from a vLLM-style checkpoint's scalar
    `{layer prefix}self_attn.k_scale` / `.v_scale` tensors; () when it has none (scales 1.0).
    Raises ValueError for a checkpoint with some of them, or a scale that is not positive."""
    names = [
        f"{layer_prefix.format(index=i)}self_attn.{kind}_scale"
        for i in range(num_layers)
        for kind in ("k", "v")
    ]
    present = [name for name in names if checkpoint.has(name)]
    if not present:
        return ()
    if len(present) != len(names):
        missing = sorted(set(names) - set(present))
        raise ValueError(f"KV cache scales missing for some layers: {', '.join(missing[:4])}")
    values = [float(checkpoint.dense(name).float().reshape(-1)[0]) for name in names]
    if not all(v > 0 for v in values):
        raise ValueError(f"KV cache scales must be positive, got {values}")
    return tuple(zip(values[0::2], values[1::2], strict=True))


def load_weights(
    model_dir: str | Path,
    arch: ModelArch,
    dtype: torch.dtype,
    *,
    formats: FormatOf | None = None,
    layer_formats: Callable[[int], FormatOf] | None = None,
    quantization: str | None = None,
    rank: Rank = SINGLE_RANK,
) -> ModelWeights:
    """Read every parameter through the family's layer spec from the checkpoint `quantization`
    reads (`checkpoints.open_checkpoint`: safetensors, or the directory's GGUF): fused (q|k|v,
    gate|up; split into runs of parts where their formats differ), sliced for `rank`, each
    linear (the embedding and head too) in its weight format (`formats(name)`; default: the
    dense format of `dtype`; layer i's `layer_formats(i)(name)` where given:
    `RuntimeConfig.layer_formats`), the rest cast to `dtype`.
    `kv_scales` are the checkpoint's KV cache scales. Raises KeyError on a missing tensor,
    ValueError when the checkpoint does not store a linear in the format asked."""
    family = family_of(arch)
    dense = dense_format(dtype).name
    format_of = formats or (lambda name: dense)
    checkpoint = open_checkpoint(model_dir, quantization, arch)
    spec = family.layer_spec(arch, dense)
    layers = [
        _load_layer(
            checkpoint,
            spec.with_formats(layer_formats(i) if layer_formats else format_of),
            family.layer_prefix.format(index=i),
            dtype,
            rank,
        )
        for i in range(arch.num_layers)
    ]
    embed = _load_vocab_rows(checkpoint, arch, family.embedding, format_of(EMBEDDING), rank)
    head_source = family.head_source(arch, has_head=checkpoint.has(f"{family.lm_head}.weight"))
    same = head_source == family.embedding and format_of(LM_HEAD) == embed.format
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=checkpoint.dense(f"{family.final_norm}.weight").to(dtype).contiguous()
        if family.final_norm
        else torch.empty(0, dtype=dtype),
        lm_head=embed
        if same
        else _load_vocab_rows(checkpoint, arch, head_source, format_of(LM_HEAD), rank),
        kv_scales=kv_scales(checkpoint, family.layer_prefix, arch.num_layers),
        embed_extras={
            name: checkpoint.dense(name).to(dtype).contiguous() for name in family.embedding_extras
        },
        rank=rank,
    )
