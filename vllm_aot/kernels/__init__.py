"""Hand-written CPU kernels, as torch custom ops, for what aten and Inductor do poorly here.

- `vllm_aot::linear_bf16(x, w)` (`linear_bf16.cpp`): `x @ w.T` for bfloat16 tensors with float32
  accumulation. On x86 CPUs without native bfloat16 arithmetic (no AVX-512 BF16 or AMX), aten's
  bfloat16 matmul runs 5-10x slower than the same product in float32 once more than one row
  multiplies the weights; this kernel widens the weights in registers and runs at float32 speed
  while reading half the bytes.
- `vllm_aot::decode_attention(q, k_new, v_new, k_pool, v_pool, block_tables, context_lens)`
  (`decode_attention.cpp`): paged attention of one query per row that reads only the row's real
  context, where the pure-torch version (`models.layers.decode_attention`, the reference) attends
  over the whole static context bucket and Inductor's code for it is mostly gathers.

Which implementation a program calls is fixed when it is compiled (`program_kernels`, part of
its cache key): the linear's from its weight format's choice for this CPU (`models/formats.py`
registers the formats and their kernels; `cpu_features()` is what the choice reads), the decode
attention's here. Compiled programs call the ops by name, so the library is loaded (`load()`)
before any program runs. `VLLM_AOT_KERNELS=0` turns every kernel off (aten and pure torch only),
for debugging and comparison.

Each `.cpp` file here defines its ops, their CPU implementation and their shape function (a Meta
implementation, which export's fake tensors run); the library is every `.cpp` file of this
folder, built on first use with the machine's C++ compiler (the one Inductor uses) into
`<cache root>/kernels/<digest of sources and torch version>/` (~15 s, once per machine) and loaded
from there afterwards; torch's extension builder locks the directory, so concurrent first uses
build it once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from vllm_aot.models.formats import ATEN, dense_format
from vllm_aot.models.linear import CpuFeatures
from vllm_aot.paths import cache_root

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# The decode attention's contract, named in the cache key of every program that calls it.
DECODE_ATTENTION = "vllm_aot.decode_attention/1"
TORCH = "torch"


def kernels_enabled() -> bool:
    """x86-64 with AVX2 and FMA, unless `VLLM_AOT_KERNELS=0`."""
    if os.environ.get("VLLM_AOT_KERNELS", "1") == "0":
        return False
    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_avx2_supported()


def cpu_features() -> CpuFeatures:
    cpu = torch.cpu
    return CpuFeatures(
        can_use_kernels=kernels_enabled(),
        has_native_bf16=cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported(),
    )


def linear_impl(dtype: torch.dtype) -> str:
    """The linear kernel programs of `dtype` call on this CPU: their weight format's choice."""
    return dense_format(dtype).kernel(cpu_features()).name


def attention_impl() -> str:
    """The decode attention our programs use: the kernel wherever kernels build."""
    return DECODE_ATTENTION if kernels_enabled() else TORCH


def program_kernels(dtype: torch.dtype) -> dict[str, str]:
    """What a program of `dtype` calls on this CPU (its cache key names it)."""
    return {"linear": linear_impl(dtype), "attention": attention_impl()}


def load_used(dtype: torch.dtype) -> None:
    """Load the library when programs of `dtype` call any of our ops (before loading one)."""
    if program_kernels(dtype) != {"linear": ATEN, "attention": TORCH}:
        load()


def decode_attention_fn(impl: str):
    """The function decode programs call for attention (`models.layers.decode_attention`'s
    signature)."""
    if impl == TORCH:
        from vllm_aot.models.layers import decode_attention

        return decode_attention
    load()
    return _kernel_decode_attention


def _kernel_decode_attention(q, k_new, v_new, k_pool, v_pool, block_tables, context_mask):
    # The mask is a prefix of each row's context bucket: its length is the row's context.
    lengths = context_mask.sum(-1)
    return torch.ops.vllm_aot.decode_attention(
        q, k_new, v_new, k_pool, v_pool, block_tables, lengths
    )


def _sources() -> list[Path]:
    return sorted(_HERE.glob("*.cpp"))


def build_dir() -> Path:
    files = _sources() + sorted(_HERE.glob("*.h"))
    blob = b"".join(p.read_bytes() for p in files) + " ".join(_FLAGS).encode()
    blob += torch.__version__.encode()
    return cache_root() / "kernels" / hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def load() -> None:
    """Build (once per machine) and load the kernels library into this process (once)."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="vllm_aot_kernels",
        sources=[str(p) for p in _sources()],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    logger.debug("vllm-aot kernels loaded from %s", directory)
