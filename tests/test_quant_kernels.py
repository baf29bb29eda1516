"""The quantised-weight kernels (`kernels/linear_<format>.cpp`) against their formats' reference
(`dequantize` then a float32 linear), on every row-count path, on the best instruction set this
CPU has and on each lower one forced in a child process (`VLLM_AOT_KERNEL_ISA=avx512_vnni`,
`avx512`, `avx2`).

The tolerance, and why: the float32 kernels multiply the activations as they are with float32
sums (no int8 activation blocks: `kernels/quant.h`), so up to kMaxDirectRows rows the result is
the reference's to float32 rounding, `1e-5 * (|x| @ |W|.T)`, and a row's result does not depend
on the other rows. bfloat16 activations become fixed point per block of 32: of the block formats
with AVX512-VNNI (15 bits, `kernels/quant_avx512_vnni.h`), of every block format on AVX2 (16
bits, `kernels/quant_avx2_fixed.h`); the K-quants' per super-block of 256 on every CPU (16 bits,
`kernels/quant_k_fixed.h`). Each x moves by at most 2^-15 of its block's largest |x|,
which adds `2^-15 * (blockmax|x| @ |W|.T)`. Beyond kMaxDirectRows the
weights are dequantised for aten's GEMM: to float32, or to bfloat16 for bfloat16 activations
where the CPU multiplies bfloat16 natively (each weight moves by at most 2^-9 of itself:
`2^-8 * (|x| @ |W|.T)` covers it). On CPUs with AMX, bfloat16 activations up to kMaxAmxRows
rows (but fewer than 5 of a block format, which take the VNNI kernel) meet the weights
dequantised tile by tile as two bfloat16 parts (`kernels/quant_amx.h`: each weight within 2^-16
of itself, `2^-15 * (|x| @ |W|.T)`), and a row's result is the same in any such batch. Outputs in
bfloat16 add their own rounding (2^-8 of the value).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import needs_kernels
from vllm_aot import kernels
from vllm_aot.models.formats import QUANTIZED_KERNELS, WEIGHT_FORMATS
from vllm_aot.models.formats_k import BLOCK_BYTES, SUPER

pytestmark = [pytest.mark.unit, needs_kernels]

ROOT = Path(__file__).resolve().parents[1]
FORMATS = tuple(QUANTIZED_KERNELS)
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 32, 33, 300)
MAX_DIRECT_ROWS = 8  # `kernels/quant.h`: kMaxDirectRows
MAX_DIRECT_ROWS_AVX2_FIXED = 32  # kMaxDirectRowsAvx2Fixed
MIN_AMX_ROWS, MAX_AMX_ROWS = 5, 32  # kMinAmxRows (formats with a VNNI kernel), kMaxAmxRows
# (out, in): in not a multiple of 128 or 256 (group and tail paths), out odd (tile tails); the
# K-quants' rows are whole super-blocks of 256.
SHAPES = ((7, 96), (33, 576), (65, 1536))
K_QUANTS = ("q4_k", "q5_k", "q6_k")  # fixed point per super-block of 256 (`quant_k_fixed.h`)
K_SHAPES = ((7, 256), (33, 2048))
DTYPES = (torch.float32, torch.bfloat16)
# The formats whose bfloat16 activations become fixed point, per instruction set (`Format` in
# `kernels/quant.h`: multiply_bf16).
# With AMX, only fewer than MIN_AMX_ROWS rows (the VNNI kernel's) are fixed point.
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
FIXED_POINT = {
    "avx2": BLOCK_FORMATS + K_QUANTS,
    "avx512": K_QUANTS,
    "avx512_vnni": BLOCK_FORMATS + K_QUANTS,
    "amx": BLOCK_FORMATS + K_QUANTS,
}


def op(fmt: str):
    return getattr(torch.ops.vllm_aot, f"linear_{fmt}")


def check_case(
    fmt: str, out_features: int, in_features: int, dtype: torch.dtype, row_counts=ROWS
) -> None:
    """Every row count of `row_counts` for one format, shape and activation dtype."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    stored = WEIGHT_FORMATS[fmt].prepare(torch.randn(out_features, in_features, generator=g))
    weight = WEIGHT_FORMATS[fmt].dequantize(*stored)
    isa = torch.ops.vllm_aot.quant_isa()
    fixed_point = fmt in FIXED_POINT[isa] and dtype == torch.bfloat16
    direct_rows = MAX_DIRECT_ROWS_AVX2_FIXED if fixed_point and isa == "avx2" else MAX_DIRECT_ROWS
    bf16_out = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    tiles = isa == "amx" and dtype == torch.bfloat16 and fmt not in K_QUANTS
    amx_rows = MAX_AMX_ROWS if tiles else 0
    for rows in row_counts:
        # Inputs of different sizes, so blocks have different scales.
        spread = torch.rand(in_features, generator=g)
        x = (torch.randn(rows, in_features, generator=g) * spread).to(dtype)
        got = op(fmt)(x, *stored)
        assert got.dtype == dtype and got.shape == (rows, out_features), (fmt, rows)
        want = F.linear(x.float(), weight)
        magnitude = x.float().abs() @ weight.abs().T
        amx = rows <= amx_rows and not (rows < MIN_AMX_ROWS and fixed_point)
        gemm_bf16 = rows > direct_rows and dtype == torch.bfloat16 and not amx
        rounding = (2.0**-8 if gemm_bf16 else 2.0**-15 if amx else 1e-5) * magnitude
        if fixed_point and rows <= direct_rows and not amx:
            # each x moved by up to 2^-15 of its block's (a K-quant's super-block's) largest |x|
            size = 256 if fmt in K_QUANTS else 32
            largest = x.float().abs().reshape(rows, -1, size).amax(-1, keepdim=True)
            rounding += 2.0**-15 * largest.expand(-1, -1, size).reshape(rows, -1) @ weight.abs().T
        tolerance = rounding + bf16_out * want.abs()
        error = (got.float() - want).abs()
        assert (error <= tolerance).all(), f"{fmt} {rows}x{in_features}: {error - tolerance}"
        if rows <= direct_rows or amx:
            # AMX's rows against a batch of MIN_AMX_ROWS (fewer rows may be VNNI's)
            probe = x[rows // 2 :][:1].repeat(MIN_AMX_ROWS if amx else 1, 1)
            alone = op(fmt)(probe, *stored)
            assert torch.equal(alone[0], got[rows // 2]), f"{fmt}: row depends on the batch"


def check_all() -> None:
    for fmt in FORMATS:
        for out_features, in_features in K_SHAPES if fmt in K_QUANTS else SHAPES:
            for dtype in DTYPES:
                check_case(fmt, out_features, in_features, dtype)


@pytest.fixture(scope="module", autouse=True)
def loaded():
    kernels.load()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_the_reference_on_every_row_path(fmt, dtype):
    for out_features, in_features in K_SHAPES if fmt in K_QUANTS else SHAPES:
        check_case(fmt, out_features, in_features, dtype)


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_5_bit_codes_on_both_sides_of_each_path_limit(fmt, dtype):
    """Row counts on both sides of kMaxDirectRows (8, 9) and kMaxDirectRowsAvx2Fixed (33, 40),
    odd output rows (tile tails); every fifth bit set and clear in some block."""
    for out_features, in_features in ((5, 64), (31, 320)):
        check_case(fmt, out_features, in_features, dtype, (1, 2, 5, 8, 9, 33, 40))


def _extreme_blocks(fmt: str) -> torch.Tensor:
    """One row of two super-blocks whose every code times its scale is the format's largest:
    q5_k codes 31 at scale 63 (mins 0), q6_k codes 0 (-32 after the offset) at scale -128."""
    block = torch.zeros(BLOCK_BYTES[fmt], dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    if fmt == "q5_k":
        block[0:2] = one  # d; dmin 0
        block[4:8] = 63  # 6-bit scales of sub-blocks 0-3
        block[12:16] = 0x0F  # scales 4-7: low four bits here, high two in bytes 4-7
        block[4:8] |= 0xC0
        block[16:176] = 0xFF  # fifth bits and nibbles: codes 31
    else:
        block[192:208] = 0x80  # int8 scales -128; codes 0
        block[208:210] = one
    return block.repeat(2).reshape(1, -1)


@pytest.mark.parametrize("fmt", ["q5_k", "q6_k"])
def test_k_quant_sums_stay_within_int32_at_the_extremes(fmt):
    """The fixed-point kernel's integer sums (`kernels/quant_k_fixed.h`) at their bound: every
    product of a run its largest, every activation its super-block's largest."""
    blocks = _extreme_blocks(fmt)
    weight = WEIGHT_FORMATS[fmt].dequantize(blocks)
    assert weight.abs().min() == weight.abs().max() == (31 * 63 if fmt == "q5_k" else 32 * 128)
    for sign in (1.0, -1.0):
        x = torch.full((1, 2 * SUPER), sign, dtype=torch.bfloat16)
        got = op(fmt)(x, blocks)
        want = F.linear(x.float(), weight)
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=0)


def _isa_levels() -> list[str]:
    """This CPU's instruction sets for our kernels, lowest first (`kernels/quant.cpp`'s rule)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    levels = ["avx2"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        levels.append("avx512")
        if "avx512_vnni" in flags:
            levels.append("avx512_vnni")
            if {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
                levels.append("amx")
    return levels


@pytest.mark.parametrize("cap", ["avx2", "avx512", "avx512_vnni"])
def test_each_lower_instruction_set_matches_too(cap):
    """The same checks in a child process capped at a lower instruction set (AVX2 is the floor
    every CPU with our kernels runs; AVX-512 without BF16 is a Skylake's or a Zen 3's lot)."""
    levels = _isa_levels()
    if cap not in levels:
        pytest.skip(f"this CPU has no {cap}")
    if cap == levels[-1]:
        pytest.skip(f"{cap} is this CPU's best, checked in this process")
    script = (
        "import torch; from vllm_aot import kernels; kernels.load()\n"
        f"assert torch.ops.vllm_aot.quant_isa() == {cap!r}\n"
        "from tests.test_quant_kernels import check_all; check_all(); print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_AOT_KERNEL_ISA": cap}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_int8_rows_of_any_length():
    """int8 rows need not be whole blocks of 32 (the part block is multiplied element-wise)."""
    stored = WEIGHT_FORMATS["int8"].prepare(torch.randn(9, 100))
    x = torch.randn(3, 100)
    want = F.linear(x, WEIGHT_FORMATS["int8"].dequantize(*stored))
    torch.testing.assert_close(op("int8")(x, *stored), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_registered_kernel_keeps_leading_dimensions_and_adds_bias(fmt):
    stored = WEIGHT_FORMATS[fmt].prepare(torch.randn(16, 256))
    kernel = WEIGHT_FORMATS[fmt].kernel(kernels.cpu_features())
    assert kernel.name == QUANTIZED_KERNELS[fmt]
    x, bias = torch.randn(2, 3, 256).bfloat16(), torch.randn(16).bfloat16()
    got = kernel.apply(x, *stored, bias)
    assert got.shape == (2, 3, 16) and got.dtype == torch.bfloat16
    want = op(fmt)(x.reshape(6, 256), *stored).reshape(2, 3, 16) + bias
    torch.testing.assert_close(got, want)
    meta = op(fmt)(x.to("meta"), *(t.to("meta") for t in stored))
    assert meta.shape == (2, 3, 16) and meta.dtype == torch.bfloat16


def test_wrong_planes_are_refused_naming_the_layout():
    qweight, scale, minimum = WEIGHT_FORMATS["q4_1"].prepare(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match=r"linear_q4_1 scale: expected Half \[8, 2\]"):
        op("q4_1")(torch.randn(1, 64), qweight, scale.float(), minimum)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 activations"):
        op("q4_1")(torch.randn(1, 64).half(), qweight, scale, minimum)
    qweight, qh, scale = WEIGHT_FORMATS["q5_0"].prepare(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match=r"linear_q5_0 qh: expected Byte \[8, 8\]"):
        op("q5_0")(torch.randn(1, 64), qweight, qh[:, :4], scale)


def test_the_chosen_path_follows_the_cpu():
    levels = _isa_levels()
    cap = os.environ.get("VLLM_AOT_KERNEL_ISA", "auto")
    expected = levels[-1] if cap == "auto" else min(cap, levels[-1], key=levels.index)
    assert torch.ops.vllm_aot.quant_isa() == expected
