"""A sparse MoE block's parameters: the router and the experts' weights stacked, their HF sources
in both layouts transformers writes, and their split over ranks.

Tensors of an `Experts` parameter named `experts` (a layer program's inputs, in this order):
- `experts.router` [num_experts, hidden]: the router's weight (dense, in the model's dtype, whole
  on every rank: each rank routes every token itself);
- `experts.w13` [rank experts, 2 * intermediate, hidden]: each expert's gate|up;
- `experts.w2` [rank experts, hidden, intermediate]: each expert's down projection;
- `experts.first_expert` [] int64: the global id of the rank's first expert. A tensor, not a
  number in the program, so every rank runs the same compiled program on its own weights.

Over ranks (`Rank`): tensor-parallel splits every expert's intermediate features (gate|up by
rows, each part on its own, as a column-parallel linear; down by columns, as a row-parallel one)
and every rank holds every expert; expert-parallel (`Rank.is_expert_parallel`) gives rank r the
whole experts [r * E / size, (r + 1) * E / size). Either way a rank's output is a partial sum,
reduced over the ranks by the layer (`LayerParams.experts`).

HF layouts (under the layer prefix, the block at the first of `Experts.modules` the checkpoint
has a router for): `save_pretrained` writes one tensor per expert and projection,
`{module}.experts.{e}.{gate}.weight` (Qwen3-MoE's `gate_proj`/`up_proj`/`down_proj`, Mixtral's
`w1`/`w3`/`w2` under `block_sparse_moe`); transformers 5's own layout
(`save_original_format=False`) stacks them, `{module}.experts.gate_up_proj` [E, 2 * I, H] and
`{module}.experts.down_proj` [E, H, I] (Mixtral's block then named `mlp`). Both load.

Expert weights are dense (`EXPERT_FORMATS`): a quantised format is refused at `with_format`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from vllm_aot.models import layers
from vllm_aot.models.config import ModelArch
from vllm_aot.models.linear import Rank, split_even

EXPERT_FORMATS = ("fp32", "bf16")  # the dense formats: a stacked [E, out, in] tensor each
_TENSORS = ("router", "w13", "w2", "first_expert")


class Tensors(Protocol):
    """What experts are read from (`checkpoints.Checkpoint`'s dense side)."""

    def has(self, name: str) -> bool: ...

    def dense(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class ExpertsKernel:
    """The function programs call for a rank's experts (`layers.moe_experts`' signature), and
    the name its program cache key carries."""

    name: str  # e.g. "torch", "vllm_aot.moe_experts/1"
    apply: Callable[..., torch.Tensor]


# What programs run for experts where our kernels do not (and what the kernel is tested against).
REFERENCE_EXPERTS = ExpertsKernel("torch", layers.moe_experts)


@dataclass(frozen=True)
class Experts:
    """A layer's sparse MoE block: router and experts, for one architecture's numbers (a rank's
    share when built from `ModelArch.for_rank`'s architecture)."""

    name: str  # our parameter name, e.g. "experts"
    modules: tuple[str, ...]  # HF module names of the block, e.g. ("block_sparse_moe", "mlp")
    projections: tuple[str, str, str]  # per-expert gate, up, down names, e.g. ("w1", "w3", "w2")
    num_experts: int  # all experts (the router's outputs)
    num_rank_experts: int  # experts a rank holds
    hidden_size: int
    intermediate_size: int  # each expert's, on a rank
    format: str  # a dense weight format name, one of EXPERT_FORMATS

    def with_format(self, fmt: str) -> Experts:
        """The same block with its experts in `fmt`; ValueError for a format not dense."""
        if fmt not in EXPERT_FORMATS:
            raise ValueError(
                f"expert weights in {fmt!r} are not supported; supported: "
                f"{', '.join(EXPERT_FORMATS)} (dense, the programs' dtype)"
            )
        return replace(self, format=fmt)

    def tensor_names(self) -> tuple[str, ...]:
        return tensor_names(self.name)

    def example_tensors(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Zeros of the programs' shapes and dtypes, in `tensor_names` order."""
        e, i, h = self.num_rank_experts, self.intermediate_size, self.hidden_size
        return (
            torch.zeros(self.num_experts, h, dtype=dtype),
            torch.zeros(e, 2 * i, h, dtype=dtype),
            torch.zeros(e, h, i, dtype=dtype),
            torch.zeros((), dtype=torch.int64),
        )


def experts_of(
    arch: ModelArch, fmt: str, *, modules: tuple[str, ...], projections: tuple[str, str, str]
) -> Experts:
    """The `experts` block of an MoE architecture (a rank's share for `for_rank`'s)."""
    return Experts(
        name="experts",
        modules=modules,
        projections=projections,
        num_experts=arch.num_experts,
        num_rank_experts=arch.num_experts_per_rank,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        format=fmt,
    ).with_format(fmt)


def tensor_names(name: str) -> tuple[str, ...]:
    """The tensors of experts `name`: router, w13, w2, first_expert (the module docstring)."""
    return tuple(f"{name}.{t}" for t in _TENSORS)


def rank_experts(num_experts: int, rank: Rank) -> range:
    """The global ids of the experts `rank` holds (all of them unless expert-parallel)."""
    if not rank.is_expert_parallel:
        return range(num_experts)
    if num_experts % rank.size:
        raise ValueError(f"experts ({num_experts}) do not split evenly over {rank.size} ranks")
    per_rank = num_experts // rank.size
    return range(rank.index * per_rank, (rank.index + 1) * per_rank)


def rank_share(arch: ModelArch, rank: Rank) -> str:
    """What `rank` holds of an MoE model's experts, for the logs."""
    ids = rank_experts(arch.num_experts, rank)
    if rank.is_expert_parallel:
        return f"experts {ids.start}-{ids.stop - 1} of {arch.num_experts} (expert parallel)"
    share = f"1/{rank.size} of each one's" if rank.size > 1 else "all"
    return f"all {arch.num_experts} experts, {share} intermediate features"


def shard_experts(
    w13: torch.Tensor, w2: torch.Tensor, rank: Rank
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rank`'s part of its experts' weights w13 [E, 2 * I, H] and w2 [E, H, I]: the whole
    experts under expert parallelism, else its slice of each expert's intermediate features."""
    if rank.is_expert_parallel:
        return w13, w2
    gate, up = w13.chunk(2, dim=1)
    what = "expert intermediate features"
    w13 = torch.cat([split_even(gate, 1, rank, what), split_even(up, 1, rank, what)], dim=1)
    return w13, split_even(w2, 2, rank, what)


def _module(tensors: Tensors, experts: Experts, prefix: str) -> str:
    """The block's HF name under `prefix`: the first of `experts.modules` with a router."""
    for module in experts.modules:
        if tensors.has(f"{prefix}{module}.gate.weight"):
            return f"{prefix}{module}"
    names = " or ".join(f"{prefix}{m}.gate.weight" for m in experts.modules)
    raise KeyError(f"weight {names} missing: no router for the MoE block")


def _stacked(tensors: Tensors, block: str, experts: Experts, ids: range):
    """w13 [len(ids), 2 * I, H] and w2 [len(ids), H, I] of experts `ids`, whole."""
    fused = f"{block}.experts.gate_up_proj"
    if tensors.has(fused):
        w13 = tensors.dense(fused)[ids.start : ids.stop]
        w2 = tensors.dense(f"{block}.experts.down_proj")[ids.start : ids.stop]
        return w13, w2
    gate, up, down = experts.projections

    def weight(e: int, projection: str) -> torch.Tensor:
        return tensors.dense(f"{block}.experts.{e}.{projection}.weight")

    w13 = torch.stack([torch.cat([weight(e, gate), weight(e, up)]) for e in ids])
    w2 = torch.stack([weight(e, down) for e in ids])
    return w13, w2


def load_experts(
    tensors: Tensors, experts: Experts, prefix: str, dtype: torch.dtype, rank: Rank
) -> tuple[torch.Tensor, ...]:
    """One layer's `experts` tensors (`Experts.tensor_names` order) for `rank`, from the HF
    tensors under `prefix` in either layout, cast to `dtype`. `experts` states the whole
    model's numbers (one rank's are its slices). Raises KeyError naming a missing tensor."""
    block = _module(tensors, experts, prefix)
    ids = rank_experts(experts.num_experts, rank)
    w13, w2 = _stacked(tensors, block, experts, ids)
    i, h = experts.intermediate_size, experts.hidden_size
    assert w13.shape == (len(ids), 2 * i, h) and w2.shape == (len(ids), h, i), (
        f"{block}.experts: gate|up {tuple(w13.shape)}, down {tuple(w2.shape)}; expected "
        f"{(len(ids), 2 * i, h)} and {(len(ids), h, i)}"
    )
    w13, w2 = shard_experts(w13, w2, rank)
    router = tensors.dense(f"{block}.gate.weight")
    first = torch.tensor(ids.start, dtype=torch.int64)
    return (*(t.to(dtype).contiguous() for t in (router, w13, w2)), first)
