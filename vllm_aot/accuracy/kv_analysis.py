"""KV cache analysis: a sequence's K and V rebuilt from the paged pool against HF's cache.

The sequence is teacher-forced through our serving path (chunk by chunk, so later chunks read
earlier ones from the pool); then each layer's K and V are gathered through its block table
(`KVCache.gather`: an FP8 pool read dequantised, stored value times the layer's scale) and
compared with HF's `past_key_values` for the same tokens, in the same dtype. Both are
post-rotary: HF rotates before it updates its cache, our layer program returns rotated keys and
`CompiledModel` writes those. Per layer: relative L-inf (max|ours - ref| / max|ref|) and relative
L2 (||ours - ref|| / ||ref||) of K and of V; per block: its L-inf error over the layer's max|ref|,
so a block written by the wrong tokens (padding leaking into a live block, a wrong slot mapping)
is named by its id; with an FP8 cache the per-layer errors are what its rounding costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_aot.accuracy.teacher_forcing import (
    HFReference,
    TokenIds,
    feed_sequence,
    sequence_blocks,
)
from vllm_aot.runtime.model import CompiledModel

DEFAULT_KV_RTOL = {"float32": 1e-3}
REDUCED_PRECISION_KV_RTOL = 5e-2
# An FP8 pool rounds each element to 3 (e4m3) or 2 (e5m2) mantissa bits: a relative error of up
# to 2^-4 or 2^-3 of the element, so of the layer's max|K| or max|V| (plus the dtype's own error).
FP8_KV_RTOL = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2}


@dataclass(frozen=True)
class KVLayerDiff:
    layer: int
    k_rel_linf: float
    k_rel_l2: float
    v_rel_linf: float
    v_rel_l2: float
    corrupted_blocks: tuple[int, ...]  # block ids whose K or V error exceeds the tolerance


@dataclass(frozen=True)
class KVReport:
    """One sequence's cache, layer by layer; `passed` iff no block is corrupted."""

    block_table: tuple[int, ...]
    num_tokens: int
    tolerance: float
    layers: tuple[KVLayerDiff, ...]

    @property
    def corrupted_blocks(self) -> tuple[int, ...]:
        """Every block corrupted in at least one layer, in block-table order."""
        bad = {b for layer in self.layers for b in layer.corrupted_blocks}
        return tuple(b for b in self.block_table if b in bad)

    @property
    def passed(self) -> bool:
        return not self.corrupted_blocks

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = [("layer", "K rel L-inf", "K rel L2", "V rel L-inf", "V rel L2", "bad blocks")]
        for d in self.layers:
            bad = ",".join(map(str, d.corrupted_blocks)) or "-"
            errors = (d.k_rel_linf, d.k_rel_l2, d.v_rel_linf, d.v_rel_l2)
            rows.append((str(d.layer), *(f"{e:.3g}" for e in errors), bad))
        return rows


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (ours - ref).double()
    linf = diff.abs().max() / ref.double().abs().max().clamp_min(1e-30)
    l2 = diff.norm() / ref.double().norm().clamp_min(1e-30)
    return float(linf), float(l2)


def _bad_blocks(
    ours: torch.Tensor, ref: torch.Tensor, block_table: Sequence[int], block_size: int, tol: float
) -> set[int]:
    """Blocks whose max|ours - ref| exceeds tol * max|ref| (the whole layer's max)."""
    scale = ref.double().abs().max().clamp_min(1e-30)
    error = (ours - ref).double().abs().flatten(1).amax(dim=1) / scale  # [tokens]
    error = torch.where(error.isnan(), torch.inf, error)
    bad = set()
    for index, block in enumerate(block_table):
        part = error[index * block_size : (index + 1) * block_size]
        if len(part) and float(part.max()) > tol:
            bad.add(block)
    return bad


def compare_kv(
    ours: Sequence[tuple[torch.Tensor, torch.Tensor]],
    reference: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_table: Sequence[int],
    *,
    block_size: int,
    tolerance: float,
) -> KVReport:
    """Per layer (K, V) pairs [tokens, kv_heads, head_dim], ours read through `block_table`."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} layers of ours vs {len(reference)} of the reference")
    layers = []
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(ours, reference, strict=True)):
        if k.shape != k_ref.shape or v.shape != v_ref.shape:
            raise ValueError(f"layer {layer}: K/V shape {tuple(k.shape)} vs {tuple(k_ref.shape)}")
        k_linf, k_l2 = _relative(k.float(), k_ref)
        v_linf, v_l2 = _relative(v.float(), v_ref)
        bad = _bad_blocks(k.float(), k_ref, block_table, block_size, tolerance)
        bad |= _bad_blocks(v.float(), v_ref, block_table, block_size, tolerance)
        layers.append(
            KVLayerDiff(
                layer=layer,
                k_rel_linf=k_linf,
                k_rel_l2=k_l2,
                v_rel_linf=v_linf,
                v_rel_l2=v_l2,
                corrupted_blocks=tuple(b for b in block_table if b in bad),
            )
        )
    return KVReport(
        block_table=tuple(block_table),
        num_tokens=len(ours[0][0]) if ours else 0,
        tolerance=tolerance,
        layers=tuple(layers),
    )


def analyse_kv(
    model: CompiledModel,
    reference: HFReference,
    token_ids: TokenIds,
    *,
    tolerance: float | None = None,
) -> KVReport:
    """Feed `token_ids` through `model`, rebuild its K/V from the pool, compare with HF's cache.

    HF runs in our model's dtype. Default tolerance: 1e-3 in float32, 5e-2 below it; with an
    FP8 KV cache 0.1 (e4m3) or 0.2 (e5m2).
    """
    config = model.config
    if tolerance is None:
        tolerance = FP8_KV_RTOL.get(
            config.kv_cache_dtype, DEFAULT_KV_RTOL.get(config.dtype, REDUCED_PRECISION_KV_RTOL)
        )
    num_tokens = len(token_ids)
    with sequence_blocks(model, num_tokens) as block_table:
        feed_sequence(model, token_ids, block_table)
        ours = [model.kv.gather(layer, block_table, num_tokens) for layer in range(len(model.kv.k))]
    ref = reference.key_values(token_ids, config.torch_dtype)
    return compare_kv(ours, ref, block_table, block_size=config.block_size, tolerance=tolerance)
