"""Backends turn a program into a callable.

- `eager`: the program's module itself; no compile (tests, debugging).
- `inductor`: a compiled AOTInductor package (`compiler.py` builds them), our equivalent of a
  Neuron NEFF: code only, weights are inputs; it loads in milliseconds without re-tracing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from vllm_aot.kernels import load_used
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, build_module


class Program(Protocol):
    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def eager_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> Program:
    module = build_module(key, arch, config)
    return torch.no_grad()(module)


def load_program(path: Path, config: RuntimeConfig) -> Program:
    """A compiled package; the kernels it calls by name are loaded into the process first."""
    load_used(config.formats_used())
    return torch._inductor.aoti_load_package(str(path))
