"""Weight formats, registered by name: how a linear's weight is stored and which kernel runs it.

A format is one `WeightFormat` here (prepare at load, example tensors for export, the kernel
choice for a CPU) plus, when it needs one, its kernel in `kernels/` (a `.cpp` file defining the op
and its shape function; `kernels.load()` builds every `.cpp` there). Adding a format touches its
kernel file, its registration below and its test, nothing else.

Programs of a dtype use the dense format of that dtype (`dense_format`); the kernel it picks is
named in every program's cache key (`kernels.program_kernels`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from vllm_aot.models.linear import CpuFeatures, LinearKernel, WeightFormat

# Kernel names: the contracts a program's cache key names; bump the version when one changes.
ATEN = "aten"
LINEAR_BF16 = "vllm_aot.linear_bf16/1"

ATEN_LINEAR = LinearKernel(ATEN, F.linear)


def _linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`kernels/linear_bf16.cpp`: x @ weight.T in bfloat16 with float32 accumulation."""
    y = torch.ops.vllm_aot.linear_bf16(x, weight)
    return y if bias is None else y + bias


def _dense(name: str, dtype: torch.dtype, kernel) -> WeightFormat:
    """A weight stored as one [out, in] tensor of `dtype`."""
    return WeightFormat(
        name=name,
        tensor_names=("weight",),
        prepare=lambda weight: (weight.to(dtype).contiguous(),),
        example=lambda out_features, in_features: (
            torch.zeros(out_features, in_features, dtype=dtype),
        ),
        kernel=kernel,
    )


def _bf16_kernel(cpu: CpuFeatures) -> LinearKernel:
    """Our kernel where the CPU has no bfloat16 arithmetic: there aten's bfloat16 matmul runs
    5-10x slower than float32 beyond one row; aten (oneDNN) where it has AVX-512 BF16 or AMX."""
    if cpu.can_use_kernels and not cpu.has_native_bf16:
        return LinearKernel(LINEAR_BF16, _linear_bf16)
    return ATEN_LINEAR


WEIGHT_FORMATS: Mapping[str, WeightFormat] = MappingProxyType(
    {
        "fp32": _dense("fp32", torch.float32, lambda cpu: ATEN_LINEAR),  # MKL is fast in fp32
        "bf16": _dense("bf16", torch.bfloat16, _bf16_kernel),
    }
)

_DENSE_BY_DTYPE = MappingProxyType({torch.float32: "fp32", torch.bfloat16: "bf16"})


def weight_format(name: str) -> WeightFormat:
    if name not in WEIGHT_FORMATS:
        raise ValueError(
            f"weight format {name!r} is not supported; supported: {', '.join(WEIGHT_FORMATS)}"
        )
    return WEIGHT_FORMATS[name]


def dense_format(dtype: torch.dtype) -> WeightFormat:
    """The format whose weights are plain [out, in] tensors of the programs' `dtype`."""
    return WEIGHT_FORMATS[_DENSE_BY_DTYPE[dtype]]
