"""Compiled programs run through the kernels library's own binding of AOTInductor's runner
(`program_runner.cpp`), which lets the GIL go for the call where torch's binding of the same
runner holds it: the engine's other Python threads move while a step's programs run. The library
is a Python extension module as well as a library of ops; it is imported as one once it is
loaded (its file is already mapped, so the import runs only the module's initialisation)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from vllm_aot.kernels import LIBRARY_FILE, kernels_enabled, library_dir, load


def program_runner(library: str):
    """AOTInductor's runner for a compiled program's model library (`library`, a `.so` path)
    whose `run(inputs)` lets the GIL go, or None where kernels are off."""
    if not kernels_enabled():
        return None
    return _extension_module().ProgramRunner(library)


@functools.cache
def _extension_module():
    load()
    spec = importlib.util.spec_from_file_location(
        Path(LIBRARY_FILE).stem, library_dir() / LIBRARY_FILE
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
