"""Backends turn a program into a callable.

- `eager`: the program's module itself; no compile (tests, debugging).
- `inductor`: a compiled AOTInductor package (`compiler.py` builds them), our equivalent of a
  Neuron NEFF: code only, weights are inputs; it loads in milliseconds without re-tracing.
"""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch.utils import _pytree as pytree

from vllm_aot.kernels import load_used
from vllm_aot.kernels.program_runner import program_runner
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, build_module


class Program(Protocol):
    def __call__(self, *args: torch.Tensor) -> Sequence[torch.Tensor]: ...


def eager_program(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> Program:
    module = build_module(key, arch, config)
    return torch.no_grad()(module)


class CompiledProgram:
    """A compiled package's model library, called straight through its runner.

    torch's package loader extracts the whole archive into a fresh `aotinductor_*` directory
    under the system's temporary directory and removes it only when the loader is destroyed,
    which a server's killed engine never does (every start left its programs behind, ~1.8 MB
    each). Ours extracts the one library the archive holds (its constants are compiled into
    it: programs take their weights as inputs) and the files beside it into a directory of its
    own, loads it and removes the directory at once; the mapped library outlives its file. It
    runs through the kernels library's runner, which lets the GIL go for the call: torch's
    binding holds it, and a server's other Python threads (the next step's schedule, the last
    one's outputs) stood still while a step ran, then stopped the step when they got it.

    Our programs take and return flat tuples of tensors, so torch's generic call (two tree-spec
    parses, a flatten and an unflatten: docs/benchmarks.md#program-calls) is skipped. The
    program's call spec is checked once, here; the outputs come back as a list.
    """

    __slots__ = ("_run",)

    def __init__(self, path: Path) -> None:
        runner = _load_runner(path)
        in_spec, out_spec = (pytree.treespec_loads(s) for s in runner.get_call_spec())
        flat_in = pytree.tree_structure((tuple(range(in_spec.num_leaves)), {}))
        flat_out = pytree.tree_structure(tuple(range(out_spec.num_leaves)))
        assert (in_spec, out_spec) == (flat_in, flat_out), (
            f"program signature {in_spec} -> {out_spec}: programs take and return flat tensors"
        )
        self._run = runner.run

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        return self._run(list(args))


def _load_runner(path: Path):
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        libraries = [n for n in names if n.endswith(".so")]
        constants = [n for n in names if "/data/constants/" in n]
        if len(libraries) != 1 or constants:
            raise RuntimeError(
                f"{path}: not one of our programs (one model library, constants compiled in); "
                f"it holds {len(libraries)} libraries and {len(constants)} constants files"
            )
        stem = libraries[0].removesuffix(".so")
        with tempfile.TemporaryDirectory(prefix="vllm-aot-program-") as scratch:
            # The runner reads the library's calls to our ops from the JSON beside it.
            for name in (n for n in names if n.startswith(stem)):
                archive.extract(name, scratch)
            library = f"{scratch}/{libraries[0]}"
            runner = program_runner(library)  # lets the GIL go while a program runs
            if runner is None:  # kernels off: torch's binding, which holds the GIL
                runner = torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1)
            return runner


def load_program(path: Path, config: RuntimeConfig) -> Program:
    """A compiled package; the kernels it calls by name are loaded into the process first."""
    load_used(config.formats_used())
    return CompiledProgram(path)
