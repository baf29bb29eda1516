"""Tensor parallelism's collectives as ops programs call: `vllm_aot_tp::all_reduce(x)` (the sum
over ranks) and `vllm_aot_tp::all_gather(x)` (ranks' tensors concatenated along the last
dimension, in rank order).

A program compiled for several ranks calls them by name where a row-parallel linear's partial
sums meet (`models.family.LayerParams.reduce`) and where the vocabulary-parallel head's logits
join; AOTInductor's programs reach them through torch's dispatcher, so they run here, in the
process that loaded the program, through whatever `Communicator` its owner installed: vLLM's
tensor-parallel group in the worker (`plugin/parallel.py`: shared memory between ranks of one
machine, gloo across machines), a `torch.distributed` group in tests. Programs never hold a
communicator, so one compiled program serves every rank.

On one rank no program calls them: a configuration of tensor-parallel size 1 compiles the same
programs it always did.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Communicator(Protocol):
    """What the ranks' owner provides: collectives over the tensor-parallel group."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `x` over the ranks (every rank gets it)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` concatenated along the last dimension, in rank order."""
        ...


_installed: list[Communicator] = []


def install(communicator: Communicator | None) -> None:
    """The communicator this process's programs use from now on (None: none)."""
    _installed[:] = [communicator] if communicator is not None else []


def is_installed() -> bool:
    """Whether this process is one of several ranks (a communicator is installed)."""
    return bool(_installed)


def _communicator() -> Communicator:
    if not _installed:
        raise RuntimeError(
            "a tensor-parallel program ran with no communicator installed "
            "(vllm_aot.kernels.collectives.install)"
        )
    return _installed[0]


@torch.library.custom_op("vllm_aot_tp::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel ranks (in a tensor of its own: communicators may
    reduce in place, and an op's output must not be its input)."""
    return _communicator().all_reduce(x.clone(memory_format=torch.contiguous_format))


@all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("vllm_aot_tp::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The `world_size` ranks' `x` concatenated along the last dimension, in rank order."""
    out = _communicator().all_gather(x.contiguous())
    assert out.shape[-1] == x.shape[-1] * world_size, (
        f"all_gather of {world_size} ranks returned {tuple(out.shape)} for {tuple(x.shape)}"
    )
    return out


@all_gather.register_fake
def _(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * world_size)


class TorchDistributed:
    """A `Communicator` over a `torch.distributed` process group (gloo on CPUs): the tests'
    ranks, and any caller that started its ranks with `torch.distributed` itself."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x, group=self.group)  # in place, as vLLM's may
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)
