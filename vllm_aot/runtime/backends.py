"""Backends turn a program into a callable.

- `eager`: the program's module itself; no compile (tests, debugging).
- `inductor`: a compiled AOTInductor package (`compiler.py` builds them), our equivalent of a
  Neuron NEFF: code only, weights are inputs; it loads in milliseconds without re-tracing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch.utils import _pytree as pytree

from vllm_aot.kernels import load_used
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, build_module


class Program(Protocol):
    def __call__(self, *args: torch.Tensor) -> Sequence[torch.Tensor]: ...


def eager_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> Program:
    module = build_module(key, arch, config)
    return torch.no_grad()(module)


class CompiledProgram:
    """A loaded AOTInductor package, called straight through its runner.

    Our programs take and return flat tuples of tensors, so torch's generic call (two tree-spec
    parses, a flatten and an unflatten, ~13 us) is skipped: 31 calls a decode step. The package's
    call spec is checked once, here; the outputs come back as a list.
    """

    __slots__ = ("_run",)

    def __init__(self, package) -> None:
        in_spec, out_spec = (pytree.treespec_loads(s) for s in package.loader.get_call_spec())
        flat_in = pytree.tree_structure((tuple(range(in_spec.num_leaves)), {}))
        flat_out = pytree.tree_structure(tuple(range(out_spec.num_leaves)))
        assert (in_spec, out_spec) == (flat_in, flat_out), (
            f"program signature {in_spec} -> {out_spec}: programs take and return flat tensors"
        )
        self._run = package.loader.boxed_run

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        return self._run(list(args))  # the runner takes the list's references


def load_program(path: Path, config: RuntimeConfig) -> Program:
    """A compiled package; the kernels it calls by name are loaded into the process first."""
    load_used(config.formats_used())
    return CompiledProgram(torch._inductor.aoti_load_package(str(path)))
