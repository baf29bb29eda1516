"""A linear layer described by its maths, its weight format and its shard.

`Linear` is `y = x @ W.T (+ b)` with `W` [out, in] built from HF tensors concatenated along the
output (q|k|v, gate|up); `format` names a `WeightFormat` (`models/formats.py`: how the weight is
stored and which kernel multiplies it) and `shard` says how the weight splits over
tensor-parallel ranks. A fused linear whose parts are stored in different formats (a GGUF's
Q4_K_M keeps `attn_v` in more bits than `attn_q`/`attn_k` in some layers) is split into runs of
consecutive parts sharing a format (`split_by_format`), each a `Linear` of its own whose outputs
the layer concatenates. The slicing is pure functions of (rank, size); only one rank runs today,
but weights are loaded through them.

Shards, as in Megatron and vLLM:
- replicated: every rank holds the whole weight;
- column: the output features split; each fused part (q, k, v) splits on its own, so a rank holds
  its heads of each; rank outputs are concatenated part by part;
- row: the input features split; rank outputs are partial sums (all-reduced), the bias is added
  once (rank 0 holds it, the others zeros);
- vocab: embedding and LM-head rows split into equal vocabulary ranges, the last padded with zero
  rows; rank outputs are concatenated and the padding dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

import torch

# The names weight formats are chosen by for the vocabulary rows (besides a layer's linears).
EMBEDDING, LM_HEAD = "embed_tokens", "lm_head"


class CheckpointFormats(NamedTuple):
    """The weight formats a checkpoint stores, as `RuntimeConfig`'s fields of the same names
    hold them: `weight_formats` (linear name or "*", format) and `layer_groups` (the layers
    stored otherwise: (layers, their (linear name, format) overrides) per further group)."""

    weight_formats: tuple[tuple[str, str], ...] = ()
    layer_groups: tuple[tuple[tuple[int, ...], tuple[tuple[str, str], ...]], ...] = ()


class Shard(StrEnum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"


@dataclass(frozen=True)
class Rank:
    """One tensor-parallel rank: `index` of `size` ranks; with `is_expert_parallel` an MoE
    layer's experts split whole over the same ranks instead of by intermediate features
    (`models/experts.py`)."""

    index: int
    size: int
    is_expert_parallel: bool = False

    def __post_init__(self) -> None:
        assert 0 <= self.index < self.size, f"rank {self.index} outside 0..{self.size - 1}"


SINGLE_RANK = Rank(0, 1)


@dataclass(frozen=True)
class Linear:
    """One linear of a model: its maths, the HF tensors it fuses, its weight format and shard."""

    name: str  # our parameter name, e.g. "qkv_proj"
    in_features: int
    out_parts: tuple[int, ...]  # output features of each fused part in order, e.g. (q, kv, kv)
    sources: tuple[str, ...]  # HF module names concatenated along the output, e.g. "mlp.up_proj"
    format: str  # a `WeightFormat` name, e.g. "bf16"
    shard: Shard = Shard.REPLICATED
    has_bias: bool = False
    # The fused linear whose run of parts this is (`split_by_format`); None: a whole linear.
    part_of: str | None = None

    @property
    def out_features(self) -> int:
        return sum(self.out_parts)


def part_name(linear: str, index: int) -> str:
    """The name formats give part `index` of fused linear `linear` by, e.g. "qkv_proj.2" (v);
    also the name of a split's run that starts at that part."""
    return f"{linear}.{index}"


def whole_name(name: str) -> str:
    """The linear a `part_name` is a part of ("qkv_proj.2" -> "qkv_proj"); others as they are."""
    linear, dot, index = name.rpartition(".")
    return linear if dot and index.isdigit() else name


def split_by_format(linear: Linear, format_of: Callable[[str], str]) -> tuple[Linear, ...]:
    """`linear` in the formats `format_of` gives its parts (by `part_name`; a part not named
    takes its linear's): whole, in `format_of(linear.name)` for a single part, when its parts
    share one format; else one `Linear` per run of consecutive parts sharing a format, named by
    the run's first part (q|k as "qkv_proj.0", v as "qkv_proj.2"), with the run's sources,
    output parts and shard (a column shard splits each part as the whole does, so a rank's
    runs concatenated are its slice of the whole)."""
    if len(linear.out_parts) == 1:
        return (replace(linear, format=format_of(linear.name)),)
    formats = [format_of(part_name(linear.name, i)) for i in range(len(linear.out_parts))]
    if len(set(formats)) == 1:
        return (replace(linear, format=formats[0]),)
    starts = [i for i, fmt in enumerate(formats) if i == 0 or fmt != formats[i - 1]]
    return tuple(
        replace(
            linear,
            name=part_name(linear.name, start),
            out_parts=linear.out_parts[start:stop],
            sources=linear.sources[start:stop],
            format=formats[start],
            part_of=linear.name,
        )
        for start, stop in zip(starts, [*starts[1:], len(formats)], strict=True)
    )


@dataclass(frozen=True)
class CpuFeatures:
    """What a kernel choice may depend on (`kernels.cpu_features()` reads this machine's)."""

    can_use_kernels: bool  # our C++ kernels build and are not switched off (x86-64, AVX2 + FMA)
    has_native_bf16: bool  # AVX-512 BF16 or AMX: aten's bfloat16 matmul runs at full speed


@dataclass(frozen=True)
class LinearKernel:
    """The function programs call for a linear, and the name its program cache key carries."""

    name: str  # e.g. "aten", "vllm_aot.linear_bf16/1"
    apply: Callable[..., torch.Tensor]  # (x [..., in], *stored tensors, bias [out] | None)


@dataclass(frozen=True)
class WeightFormat:
    """How a linear's weight is stored and multiplied; one registration per format.

    `prepare` runs once at load on the (sharded, fused) float weight [out, in] and returns the
    stored tensors, named by `tensor_names` (each with the output rows as its first dimension);
    `example` gives tensors of the stored shapes and dtypes for export; `kernel` picks the
    implementation for a CPU; `dequantize` turns stored tensors back into float32 [out, in] (the
    reference kernels are tested against, embedding lookups, the accuracy tools). Programs take
    the stored tensors as inputs, then the bias (in the activation dtype) when the linear has one.
    """

    name: str
    tensor_names: tuple[str, ...]
    prepare: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    example: Callable[[int, int], tuple[torch.Tensor, ...]]  # (out, in) -> stored tensors
    kernel: Callable[[CpuFeatures], LinearKernel]
    dequantize: Callable[..., torch.Tensor]  # (*stored) -> float32 [out, in]


def split_even(tensor: torch.Tensor, dim: int, rank: Rank, what: str) -> torch.Tensor:
    """`rank`'s equal part of `tensor` along `dim`; ValueError naming `what` when uneven."""
    size = tensor.shape[dim]
    if size % rank.size:
        raise ValueError(f"{what} ({size}) does not split evenly over {rank.size} ranks")
    return tensor.narrow(dim, rank.index * (size // rank.size), size // rank.size)


def vocab_rows_per_rank(vocab_size: int, num_ranks: int) -> int:
    """The embedding or LM-head rows each rank holds under `Shard.VOCAB` (the last padded)."""
    return -(-vocab_size // num_ranks)


def _split_vocab(tensor: torch.Tensor, rank: Rank) -> torch.Tensor:
    """Rows [index * per_rank, (index + 1) * per_rank), zero rows past the vocabulary."""
    per_rank = vocab_rows_per_rank(tensor.shape[0], rank.size)
    part = tensor[rank.index * per_rank : (rank.index + 1) * per_rank]
    padding = part.new_zeros(per_rank - part.shape[0], *part.shape[1:])
    return torch.cat([part, padding]) if padding.shape[0] else part


def shard_weight(linear: Linear, weight: torch.Tensor, rank: Rank) -> torch.Tensor:
    """`rank`'s slice of the fused weight [out, in] (its fused parts in `linear.out_parts`)."""
    assert weight.shape == (linear.out_features, linear.in_features), (
        f"{linear.name}: weight {tuple(weight.shape)}, expected "
        f"{(linear.out_features, linear.in_features)}"
    )
    return _shard_rows_first(linear, weight, rank)


def shard_stored(
    linear: Linear, stored: tuple[torch.Tensor, ...], rank: Rank
) -> tuple[torch.Tensor, ...]:
    """`rank`'s slices of a weight's stored tensors, plane by plane (each [out, ...], the output
    rows first): rows as `shard_weight` splits them; for a row shard each plane's second
    dimension (inputs, or the bytes and blocks holding them) splits evenly and a per-row plane
    [out] stays whole. Equal to storing `shard_weight`'s slice when a rank's inputs are whole
    blocks."""
    assert all(t.shape[0] == linear.out_features for t in stored), (
        f"{linear.name}: stored rows {[tuple(t.shape) for t in stored]}, expected "
        f"{linear.out_features}"
    )
    return tuple(
        t if linear.shard is Shard.ROW and t.dim() == 1 else _shard_rows_first(linear, t, rank)
        for t in stored
    )


def _shard_rows_first(linear: Linear, weight: torch.Tensor, rank: Rank) -> torch.Tensor:
    if linear.shard is Shard.COLUMN:
        parts = weight.split(linear.out_parts)
        what = f"{linear.name} output features"
        return torch.cat([split_even(p, 0, rank, what) for p in parts])
    if linear.shard is Shard.ROW:
        return split_even(weight, 1, rank, f"{linear.name} input features")
    if linear.shard is Shard.VOCAB:
        return _split_vocab(weight, rank)
    return weight


def shard_bias(linear: Linear, bias: torch.Tensor, rank: Rank) -> torch.Tensor:
    """`rank`'s part of the fused bias [out]: sliced as the weight's rows, or, for a row shard,
    whole on rank 0 and zeros elsewhere (the rank outputs are summed)."""
    if linear.shard is Shard.ROW:
        return bias if rank.index == 0 else torch.zeros_like(bias)
    if linear.shard is Shard.COLUMN:
        parts = bias.split(linear.out_parts)
        what = f"{linear.name} output features"
        return torch.cat([split_even(p, 0, rank, what) for p in parts])
    if linear.shard is Shard.VOCAB:
        return _split_vocab(bias, rank)
    return bias


def shard_input(linear: Linear, x: torch.Tensor, rank: Rank) -> torch.Tensor:
    """The activations [..., in] `rank` multiplies: its slice of the features for a row shard."""
    if linear.shard is Shard.ROW:
        return split_even(x, x.dim() - 1, rank, f"{linear.name} input features")
    return x


def gather_outputs(linear: Linear, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every rank's output [..., local out] (in rank order) -> the full output [..., out]."""
    if linear.shard is Shard.ROW:
        return torch.stack(list(outputs)).sum(0)
    if linear.shard is Shard.REPLICATED:
        return outputs[0]
    if linear.shard is Shard.VOCAB:
        return torch.cat(list(outputs), dim=-1)[..., : linear.out_features]
    size = len(outputs)
    pieces = [o.split([p // size for p in linear.out_parts], dim=-1) for o in outputs]
    return torch.cat([piece[i] for i in range(len(linear.out_parts)) for piece in pieces], dim=-1)
