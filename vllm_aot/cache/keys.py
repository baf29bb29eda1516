"""Cache keys: what a compiled program depends on, digested so any machine computes the same key.

A program's key covers the architecture (numbers only, no names or paths), the program's own
shape (kind, bucket sizes), the runtime fields its graph reads (dtype, block size, logprobs,
sampling candidates), the backend, the kernels it calls, the versions of torch and
vllm-aot, the Inductor flags that change code generation and the CPU vector ISA the code is
generated for. Nothing machine-specific
(paths, hostnames, users) enters a key: a shared store hits on every machine with the same
versions and ISA, and misses, visibly, on any other.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

import torch

import vllm_aot
from vllm_aot.kernels import program_kernels
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey

# Bump when the programs' code changes in a way the versions below do not capture.
CACHE_FORMAT = 2
# RuntimeConfig fields a program's graph depends on (bucket sets and limits only pick programs).
_PROGRAM_FIELDS = ("dtype", "block_size", "num_logprobs", "num_sampling_candidates")


def digest(payload: Any, length: int = 32) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def cpu_target() -> str:
    """The code generation target: machine and the vector ISA Inductor picks here (e.g. avx2)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"{platform.machine()}-{pick_vec_isa() or 'novec'}"


def compiler_flags() -> dict[str, Any]:
    """Inductor settings that change the generated code (read after any TORCHINDUCTOR_* env)."""
    from torch._inductor import config

    from vllm_aot.runtime.backends import INDUCTOR_SETTINGS

    return {
        **INDUCTOR_SETTINGS,
        "cpp.simdlen": config.cpp.simdlen,
        "max_autotune": config.max_autotune,
        "freezing": config.freezing,
        "aot_inductor.compile_wrapper_opt_level": getattr(
            config.aot_inductor, "compile_wrapper_opt_level", None
        ),
    }


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "vllm_aot": vllm_aot.__version__}


def arch_digest(arch: ModelArch) -> str:
    """One architecture's digest: fine-tunes of the same shape share it (and their programs)."""
    return digest(arch.digest_fields(), 16)


def program_fingerprint(arch: ModelArch, config: RuntimeConfig, key: ProgramKey) -> dict[str, Any]:
    shapes = config.shape_fields()
    return {
        "format": CACHE_FORMAT,
        "arch": arch.digest_fields(),
        "program": {"kind": key.kind.value, "size": key.size, "context": key.context_tokens},
        "runtime": {name: shapes[name] for name in _PROGRAM_FIELDS},
        "backend": "inductor",
        "flags": compiler_flags(),
        "kernels": program_kernels(config.torch_dtype),
        "target": cpu_target(),
        **versions(),
    }


def program_cache_key(arch: ModelArch, config: RuntimeConfig, key: ProgramKey) -> str:
    return digest(program_fingerprint(arch, config, key))
