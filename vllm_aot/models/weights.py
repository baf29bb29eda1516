"""HF safetensors directory -> our fused parameters, loaded once and shared by every program."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open

from vllm_aot.models.config import ModelArch
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
    shard_weight,
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
    final_norm: torch.Tensor  # [hidden]
    lm_head: StoredWeight  # [vocab, hidden]; the embedding itself when tied (same format)

    def num_bytes(self) -> int:
        tensors = [*self.embed.tensors, self.final_norm, *self.lm_head.tensors]
        tensors += [t for layer in self.layers for t in layer.values()]
        unique = {t.data_ptr(): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


class _Checkpoint:
    """The HF tensors of one directory, read once; a missing one is a KeyError naming it."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.tensors = _read_tensors(model_dir)

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        return self.tensors[name]

    def fused(self, prefix: str, linear: Linear, suffix: str) -> torch.Tensor:
        """The linear's sources' `suffix` tensors ("weight", "bias") concatenated on the output."""
        parts = [self.take(f"{prefix}{source}.{suffix}") for source in linear.sources]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _load_layer(
    checkpoint: _Checkpoint, spec: LayerSpec, prefix: str, dtype: torch.dtype, rank: Rank
) -> LayerWeights:
    tensors: list[torch.Tensor] = []
    for param in spec.params:
        if isinstance(param, Norm):
            norm = checkpoint.take(f"{prefix}{param.source}.weight")
            tensors.append(norm.to(dtype).contiguous())
            continue
        weight = shard_weight(param, checkpoint.fused(prefix, param, "weight"), rank)
        tensors += weight_format(param.format).prepare(weight)
        if param.has_bias:
            bias = shard_bias(param, checkpoint.fused(prefix, param, "bias"), rank)
            tensors.append(bias.to(dtype).contiguous())
    return dict(zip(spec.tensor_names(), tensors, strict=True))


def _load_vocab_rows(
    checkpoint: _Checkpoint, arch: ModelArch, source: str, fmt: str, rank: Rank
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
    weight = shard_weight(rows, checkpoint.fused("", rows, "weight"), rank)
    return StoredWeight(fmt, weight_format(fmt).prepare(weight))


def load_weights(
    model_dir: str | Path,
    arch: ModelArch,
    dtype: torch.dtype,
    *,
    formats: FormatOf | None = None,
    rank: Rank = SINGLE_RANK,
) -> ModelWeights:
    """Read every parameter through the family's layer spec: fused (q|k|v, gate|up), sliced for
    `rank`, each linear (the embedding and head too) prepared in its weight format
    (`formats(name)`; default: the dense format of `dtype`), the rest cast to `dtype`.
    Raises KeyError on a missing tensor."""
    family = family_of(arch)
    dense = dense_format(dtype).name
    format_of = formats or (lambda name: dense)
    checkpoint = _Checkpoint(Path(model_dir))
    spec = family.layer_spec(arch, dense).with_formats(format_of)
    layers = [
        _load_layer(checkpoint, spec, family.layer_prefix.format(index=i), dtype, rank)
        for i in range(arch.num_layers)
    ]
    embed = _load_vocab_rows(checkpoint, arch, family.embedding, format_of(EMBEDDING), rank)
    is_tied = arch.tie_word_embeddings or f"{family.lm_head}.weight" not in checkpoint.tensors
    head_source = family.embedding if is_tied else family.lm_head
    same = is_tied and format_of(LM_HEAD) == embed.format
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=checkpoint.take(f"{family.final_norm}.weight").to(dtype).contiguous(),
        lm_head=embed
        if same
        else _load_vocab_rows(checkpoint, arch, head_source, format_of(LM_HEAD), rank),
    )
