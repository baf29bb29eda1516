"""Weight formats, registered by name: how a linear's weight is stored and which kernel runs it.

A format is one `WeightFormat` here (prepare at load, example tensors for export, dequantise, the
kernel choice for a CPU) plus, when it needs one, its kernel in `kernels/` (a `.cpp` file defining
the op and its shape function; `kernels.load()` builds every `.cpp` there). Adding a format
touches its kernel file, its registration below and its test, nothing else.

The formats and their stored tensors (every tensor's first dimension is the output row, so rows
are fused, permuted and sharded plane by plane; GGUF blocks hold 32 consecutive inputs of a row):
- `fp32`, `bf16`: `weight` [out, in] of that dtype (the dense formats: `dense_format(dtype)`).
- `int8`: `qweight` int8 [out, in] and `scale` float32 [out]; w = q * scale (per-output-channel
  symmetric, weight-only: any checkpoint quantised at load).
- `q8_0` (GGUF): `qweight` int8 [out, in] and `scale` float16 [out, in / 32]; w = q * d.
- `q4_0` (GGUF): `qweight` uint8 [out, in / 2] and `scale` float16 [out, in / 32]; byte j of a
  block's 16 holds input j (low nibble) and input j + 16 (high nibble); w = (q - 8) * d.
- `q4_1` (GGUF): `qweight` uint8 [out, in / 2] as q4_0's, `scale` and `min` float16
  [out, in / 32]; w = q * d + m.
- `q5_0`, `q5_1` (GGUF): q4_0's and q4_1's planes with 5-bit codes, `qh` uint8 [out, in / 8]
  beside `qweight` holding each code's fifth bit (4 bytes a block: bit j of their little-endian
  uint32 is input j's); w = (q - 16) * d, w = q * d + m.
- `q4_k`, `q5_k`, `q6_k` (GGUF K-quants): `blocks` uint8 [out, in / 256 * 144 | 176 | 210], the
  file's super-blocks of 256 inputs as stored (layouts in `formats_k.py`).
GGUF files give the quantised formats' tensors as they are (`models/gguf.py`); `prepare`
quantises a float weight the way llama.cpp does (tests, `--quantization int8`; the K-quants' by a
simpler rule, for tests).

Which kernel a format picks on a CPU is named in every program's cache key
(`kernels.program_kernels`): the quantised formats' own op (`kernels/linear_<format>.cpp`, bias
added after) wherever our kernels run, else their pure-torch dequantisation (the reference the
kernels are tested against).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fractions import Fraction
from types import MappingProxyType

import torch
import torch.nn.functional as F

from vllm_aot.models import formats_k
from vllm_aot.models.linear import CpuFeatures, LinearKernel, WeightFormat

# Kernel names: the contracts a program's cache key names; bump the version when one changes.
ATEN = "aten"
LINEAR_BF16 = "vllm_aot.linear_bf16/1"

# The quantised formats' kernels (`kernels/linear_<format>.cpp`): x @ W.T from the stored tensors.
QUANTIZED_KERNELS = MappingProxyType(
    {
        **{fmt: f"vllm_aot.linear_{fmt}/2" for fmt in ("int8", "q8_0", "q4_0", "q4_1")},
        **{fmt: f"vllm_aot.linear_{fmt}/1" for fmt in ("q5_0", "q5_1")},
        **{fmt: f"vllm_aot.linear_{fmt}/1" for fmt in formats_k.BLOCK_BYTES},
    }
)

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
        dequantize=lambda weight: weight.float(),
    )


def _bf16_kernel(cpu: CpuFeatures) -> LinearKernel:
    """Our kernel where the CPU has no bfloat16 arithmetic, where aten's bfloat16 matmul runs
    far slower than float32 beyond one row (docs/benchmarks.md#bfloat16-linears); aten (oneDNN)
    where it has AVX-512 BF16 or AMX."""
    if cpu.can_use_kernels and not cpu.has_native_bf16:
        return LinearKernel(LINEAR_BF16, _linear_bf16)
    return ATEN_LINEAR


BLOCK = 32  # inputs per GGUF block (q8_0, q4_0, q4_1, q5_0, q5_1)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> float32 [out, in / 32, 32], refusing rows that are not whole blocks."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"GGUF block formats need in_features divisible by {BLOCK}")
    return weight.float().reshape(out_features, in_features // BLOCK, BLOCK)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16 [out, blocks, 32] -> [out, blocks * 16]: input j low, j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def _unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """[out, in / 2] uint8 -> float32 [out, in / 32, 32] of the nibbles in input order."""
    packed = qweight.reshape(qweight.shape[0], -1, 16)
    return torch.cat([packed & 15, packed >> 4], dim=-1).float()


def _quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scale = weight.float().abs().amax(dim=1) / 127
    q = (weight.float() / scale.clamp_min(1e-30)[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8).contiguous(), scale.contiguous()


def _dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[:, None]


def _quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    blocks = _blocks(weight)
    d = (blocks.abs().amax(dim=-1) / 127).half()
    inv = torch.where(d > 0, 1 / d.float(), 0.0)
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape).contiguous(), d.contiguous()


def _dequantize_q8_0(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = qweight.float().reshape(*scale.shape, BLOCK) * scale.float()[..., None]
    return blocks.reshape(qweight.shape)


def _quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """llama.cpp's rule: d = the block's value of largest magnitude / -8, q = trunc(x / d + 8.5)."""
    blocks = _blocks(weight)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = (extreme / -8).half()
    inv = torch.where(d != 0, 1 / d.float(), 0.0)
    q = (blocks * inv[..., None] + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    return _pack_nibbles(q).contiguous(), d.contiguous()


def _dequantize_q4_0(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = (_unpack_nibbles(qweight) - 8) * scale.float()[..., None]
    return blocks.reshape(qweight.shape[0], -1)


def _quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """llama.cpp's rule: m = the block's minimum, d = (max - min) / 15,
    q = trunc((x - m) / d + 0.5)."""
    blocks = _blocks(weight)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d, m = ((high - low) / 15).half(), low.half()
    inv = torch.where(d != 0, 1 / d.float(), 0.0)
    q = ((blocks - low[..., None]) * inv[..., None] + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    return _pack_nibbles(q).contiguous(), d.contiguous(), m.contiguous()


def _dequantize_q4_1(qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    blocks = _unpack_nibbles(qweight) * scale.float()[..., None] + minimum.float()[..., None]
    return blocks.reshape(qweight.shape[0], -1)


def _pack_high(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 32 [out, blocks, 32] -> their fifth bits, uint8 [out, blocks * 4]: bit j of
    a block's 4 bytes (a little-endian uint32) is input j's."""
    bits = (q >> 4).reshape(q.shape[0], -1, 4, 8).to(torch.int32)
    weights = torch.arange(8, dtype=torch.int32)
    return (bits << weights).sum(dim=-1).to(torch.uint8).reshape(q.shape[0], -1)


def _unpack_codes5(qweight: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """The nibbles and fifth bits -> float32 [out, in / 32, 32] of the 5-bit codes."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh.reshape(qh.shape[0], -1, 4, 1) >> shifts) & 1
    return _unpack_nibbles(qweight) + 16 * bits.reshape(qh.shape[0], -1, BLOCK).float()


def _quantize_q5_0(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """llama.cpp's rule: d = the block's value of largest magnitude / -16,
    q = trunc(x / d + 16.5) (at most 31)."""
    blocks = _blocks(weight)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    d = extreme / -16
    inv = torch.where(d != 0, 1 / d, 0.0)
    q = (blocks * inv[..., None] + 16.5).trunc().clamp(0, 31).to(torch.uint8)
    return _pack_nibbles(q & 15).contiguous(), _pack_high(q), d.half().contiguous()


def _dequantize_q5_0(qweight: torch.Tensor, qh: torch.Tensor, scale: torch.Tensor):
    blocks = (_unpack_codes5(qweight, qh) - 16) * scale.float()[..., None]
    return blocks.reshape(qweight.shape[0], -1)


def _quantize_q5_1(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """llama.cpp's rule: m = the block's minimum, d = (max - min) / 31,
    q = trunc((x - m) / d + 0.5)."""
    blocks = _blocks(weight)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d = (high - low) / 31
    inv = torch.where(d != 0, 1 / d, 0.0)
    q = ((blocks - low[..., None]) * inv[..., None] + 0.5).trunc().clamp(0, 31).to(torch.uint8)
    planes = (_pack_nibbles(q & 15), _pack_high(q), d.half(), low.half())
    return tuple(p.contiguous() for p in planes)


def _dequantize_q5_1(qweight, qh, scale, minimum):
    codes = _unpack_codes5(qweight, qh)
    blocks = codes * scale.float()[..., None] + minimum.float()[..., None]
    return blocks.reshape(qweight.shape[0], -1)


def _quantized_kernel(name: str, dequantize) -> Callable[[CpuFeatures], LinearKernel]:
    """Our op where our kernels run (`kernels/quant.h`), else the pure-torch multiplication:
    dequantise to float32, multiply, in the activations' dtype."""

    def reference(x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        *tensors, bias = stored
        y = F.linear(x.float(), dequantize(*tensors))
        return (y if bias is None else y + bias.float()).to(x.dtype)

    def ours(x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        *tensors, bias = stored
        y = getattr(torch.ops.vllm_aot, f"linear_{name}")(x, *tensors)
        return y if bias is None else y + bias

    kernel = LinearKernel(QUANTIZED_KERNELS[name], ours)
    fallback = LinearKernel(f"torch.dequantize/{name}", reference)
    return lambda cpu: kernel if cpu.can_use_kernels else fallback


def _planes(*planes: tuple[torch.dtype, int]) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    """Example tensors, one per (dtype, inputs per element, an int or a Fraction: 0 for one per
    output row)."""

    def example(out_features: int, in_features: int) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.zeros(out_features, int(in_features / per), dtype=dtype)
            if per
            else torch.zeros(out_features, dtype=dtype)
            for dtype, per in planes
        )

    return example


def _quantized(name, tensor_names, quantize, dequantize, planes) -> WeightFormat:
    return WeightFormat(
        name=name,
        tensor_names=tensor_names,
        prepare=quantize,
        example=_planes(*planes),
        kernel=_quantized_kernel(name, dequantize),
        dequantize=dequantize,
    )


_I8, _U8, _F16, _F32 = torch.int8, torch.uint8, torch.float16, torch.float32

WEIGHT_FORMATS: Mapping[str, WeightFormat] = MappingProxyType(
    {
        "fp32": _dense("fp32", torch.float32, lambda cpu: ATEN_LINEAR),  # MKL is fast in fp32
        "bf16": _dense("bf16", torch.bfloat16, _bf16_kernel),
        "int8": _quantized(
            "int8", ("qweight", "scale"), _quantize_int8, _dequantize_int8, [(_I8, 1), (_F32, 0)]
        ),
        "q8_0": _quantized(
            "q8_0", ("qweight", "scale"), _quantize_q8_0, _dequantize_q8_0, [(_I8, 1), (_F16, 32)]
        ),
        "q4_0": _quantized(
            "q4_0", ("qweight", "scale"), _quantize_q4_0, _dequantize_q4_0, [(_U8, 2), (_F16, 32)]
        ),
        "q4_1": _quantized(
            "q4_1",
            ("qweight", "scale", "min"),
            _quantize_q4_1,
            _dequantize_q4_1,
            [(_U8, 2), (_F16, 32), (_F16, 32)],
        ),
        "q5_0": _quantized(
            "q5_0",
            ("qweight", "qh", "scale"),
            _quantize_q5_0,
            _dequantize_q5_0,
            [(_U8, 2), (_U8, 8), (_F16, 32)],
        ),
        "q5_1": _quantized(
            "q5_1",
            ("qweight", "qh", "scale", "min"),
            _quantize_q5_1,
            _dequantize_q5_1,
            [(_U8, 2), (_U8, 8), (_F16, 32), (_F16, 32)],
        ),
        **{
            fmt: _quantized(
                fmt,
                ("blocks",),
                getattr(formats_k, f"quantize_{fmt}"),
                getattr(formats_k, f"dequantize_{fmt}"),
                [(_U8, Fraction(formats_k.SUPER, size))],
            )
            for fmt, size in formats_k.BLOCK_BYTES.items()
        },
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


def take_rows(
    fmt: WeightFormat, stored: tuple[torch.Tensor, ...], ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of a stored weight, dequantised to float32 [len(ids), in] (an embedding lookup
    that never widens the whole table)."""
    return fmt.dequantize(*(tensor[ids] for tensor in stored))
