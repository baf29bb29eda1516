"""Our quantised-linear kernels on the bundled model's shapes, beside the bfloat16 linear and the
machine's memory bandwidth.

    .venv/bin/python bench/kernel_bench.py [--formats q4_1,q8_0,q4_0,q5_0,q5_1,int8]
                                           [--rows 1,8,32,256] [--dtype bfloat16] [--repeats 7]
    .venv/bin/python bench/kernel_bench.py --mlp [--formats q4_0,...,q6_k] [--dtype float32]

Every call reads weights from memory, not from a cache: each shape's stored weights are copied
until the copies pass 4x the last-level cache and the calls rotate through them (a decode step
reads ~100 MB of weights once, so this is what the model sees). Per format, linear and row
count: the median time per call over `--repeats` passes, for one row the weight bytes read per
second and their share of the measured bandwidth (a sum over 1 GiB on torch's threads), and the
bfloat16 linear's time on the same shape divided by ours (this CPU's bf16 kernel choice:
`models/formats.py`). Then one batch-1 decode step's linears (30 layers and the head) per format
(the K-quants, whose rows are super-blocks of 256 inputs, skip the bundled model's 576-input
linears). `--mlp`: instead, the GGUF block formats side by side on Llama-3.2-1B's MLP linears,
1 and 8 rows: time and weight bytes per second. The machine may be shared: medians of several
passes, still noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from vllm_aot import kernels
from vllm_aot.models.formats import WEIGHT_FORMATS
from vllm_aot.models.formats_k import BLOCK_BYTES, SUPER

# The bundled SmolLM2-135M's linears [out, in] (hidden 576, 9 + 2 x 3 heads of 64, MLP 1536).
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30
# Llama-3.2-1B's MLP linears [out, in] (hidden 2048, MLP 8192): gate/up and down.
MLP_SHAPES = {"gate/up": (8192, 2048), "down": (2048, 8192)}
MLP_FORMATS = "q4_0,q4_1,q8_0,q4_k,q5_k,q6_k"
ROTATION_BYTES = 128 << 20  # 4x this machine's 32 MiB L3


@dataclass(frozen=True)
class Case:
    """One linear in one format: its kernel and enough copies of its weight to rotate through."""

    fmt: str
    apply: Callable[..., torch.Tensor]
    copies: tuple[tuple[torch.Tensor, ...], ...]

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies[0])


def make_case(fmt: str, shape: tuple[int, int], num_copies: int | None = None) -> Case:
    g = torch.Generator().manual_seed(0)
    stored = WEIGHT_FORMATS[fmt].prepare(torch.randn(*shape, generator=g) * 0.05)
    nbytes = sum(t.numel() * t.element_size() for t in stored)
    num = num_copies or max(1, -(-ROTATION_BYTES // nbytes))
    copies = (stored, *(tuple(t.clone() for t in stored) for _ in range(num - 1)))
    kernel = WEIGHT_FORMATS[fmt].kernel(kernels.cpu_features())
    return Case(fmt, lambda x, *w: kernel.apply(x, *w, None), copies)


def seconds_per_call(case: Case, x: torch.Tensor, repeats: int) -> float:
    """The median over `repeats` passes through every copy of the weight."""
    for stored in case.copies[:4]:
        case.apply(x, *stored)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for stored in case.copies:
            case.apply(x, *stored)
        samples.append((time.perf_counter() - start) / len(case.copies))
    return statistics.median(samples)


def measured_bandwidth(repeats: int) -> float:
    """Bytes per second of a sum over 1 GiB of float32 on torch's threads (the median)."""
    buffer = torch.ones(1 << 28)
    buffer.sum()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        samples.append(buffer.numel() * 4 / (time.perf_counter() - start))
    return statistics.median(samples)


def activations(rows: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)


def shape_table(args, bandwidth: float) -> Table:
    table = Table(title=f"per linear, x {args.dtype} ({torch.get_num_threads()} threads)")
    for column in (
        "format",
        "linear",
        "[out, in]",
        "rows",
        "us/call",
        "GB/s",
        "% of bw",
        "bf16 us",
        "bf16/ours",
    ):
        table.add_column(column, justify="left" if column in ("format", "linear") else "right")
    dtype = getattr(torch, args.dtype)
    shapes = {**LAYER_SHAPES, "head": HEAD_SHAPE}
    dense = {name: make_case("bf16", shape) for name, shape in shapes.items()}
    for fmt in args.formats:
        for name, shape in shapes.items():
            if name == "head" and fmt != "q8_0":  # the bundled model's head
                continue
            if fmt in BLOCK_BYTES and shape[1] % SUPER:  # not whole super-blocks
                continue
            case = make_case(fmt, shape)
            for rows in args.rows:
                x = activations(rows, shape[1], dtype)
                ours = seconds_per_call(case, x, args.repeats)
                bf16 = seconds_per_call(dense[name], x.bfloat16(), args.repeats)
                rate = case.weight_bytes / ours
                memory = (
                    [f"{rate / 1e9:.1f}", f"{100 * rate / bandwidth:.0f}"]
                    if rows == 1
                    else ["", ""]
                )
                table.add_row(
                    fmt,
                    name,
                    f"{list(shape)}",
                    str(rows),
                    f"{ours * 1e6:.1f}",
                    *memory,
                    f"{bf16 * 1e6:.1f}",
                    f"{bf16 / ours:.2f}",
                )
            del case
    return table


def decode_step_seconds(fmt: str, head_fmt: str, dtype: torch.dtype, repeats: int):
    """One batch-1 decode step's linears: (seconds, weight bytes)."""
    layers = [make_case(fmt, shape, num_copies=NUM_LAYERS) for shape in LAYER_SHAPES.values()]
    head = make_case(head_fmt, HEAD_SHAPE, num_copies=1)
    xs = [activations(1, shape[1], dtype) for shape in (*LAYER_SHAPES.values(), HEAD_SHAPE)]

    def step() -> None:
        for layer in range(NUM_LAYERS):
            for case, x in zip(layers, xs, strict=False):
                case.apply(x, *case.copies[layer])
        head.apply(xs[-1], *head.copies[0])

    step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    nbytes = NUM_LAYERS * sum(c.weight_bytes for c in layers) + head.weight_bytes
    return statistics.median(samples), nbytes


def step_table(args, bandwidth: float) -> Table:
    table = Table(title="one batch-1 decode step's linears (30 layers + head)")
    for column in ("layers", "head", "MB", "ms", "GB/s", "% of bw", "bf16 ms", "bf16/ours"):
        table.add_column(column, justify="right")
    dtype = getattr(torch, args.dtype)
    bf16, _ = decode_step_seconds("bf16", "bf16", torch.bfloat16, args.repeats)
    for fmt in [f for f in args.formats if f not in BLOCK_BYTES]:
        head_fmt = "q8_0" if fmt in ("q4_1", "q4_0", "q8_0", "q5_0", "q5_1") else fmt
        seconds, nbytes = decode_step_seconds(fmt, head_fmt, dtype, args.repeats)
        table.add_row(
            fmt,
            head_fmt,
            f"{nbytes / 1e6:.0f}",
            f"{seconds * 1e3:.2f}",
            f"{nbytes / seconds / 1e9:.1f}",
            f"{100 * nbytes / seconds / bandwidth:.0f}",
            f"{bf16 * 1e3:.2f}",
            f"{bf16 / seconds:.2f}",
        )
    return table


def mlp_table(args, bandwidth: float) -> Table:
    """The formats side by side on Llama-3.2-1B's MLP linears: 1 and 8 rows."""
    table = Table(
        title=f"Llama-3.2-1B MLP linears, x {args.dtype} ({torch.get_num_threads()} threads)"
    )
    for column in ("format", "[out, in]", "MB", "1 row us", "GB/s", "% of bw", "8 rows us", "GB/s"):
        table.add_column(column, justify="left" if column == "format" else "right")
    dtype = getattr(torch, args.dtype)
    for fmt in args.formats:
        for shape in MLP_SHAPES.values():
            case = make_case(fmt, shape)
            row = [fmt, f"{list(shape)}", f"{case.weight_bytes / 1e6:.1f}"]
            for rows in (1, 8):
                seconds = seconds_per_call(case, activations(rows, shape[1], dtype), args.repeats)
                rate = case.weight_bytes / seconds
                row += [f"{seconds * 1e6:.0f}", f"{rate / 1e9:.1f}"]
                row += [f"{100 * rate / bandwidth:.0f}"] if rows == 1 else []
            table.add_row(*row)
            del case
    return table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=None, type=lambda s: s.split(","))
    parser.add_argument("--rows", default="1,8,32,256", type=lambda s: list(map(int, s.split(","))))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-shapes", action="store_true", help="only the decode step")
    parser.add_argument("--mlp", action="store_true", help="the GGUF formats on Llama-3.2-1B's MLP")
    args = parser.parse_args(argv)
    default = MLP_FORMATS if args.mlp else "q4_1,q8_0,q4_0,q5_0,q5_1,int8"
    args.formats = args.formats or default.split(",")
    kernels.load()
    console = Console(width=160)
    bandwidth = measured_bandwidth(args.repeats)
    isa = torch.ops.vllm_aot.quant_isa()
    console.print(f"memory bandwidth (1 GiB sum): {bandwidth / 1e9:.1f} GB/s; kernels: {isa}")
    if args.mlp:
        console.print(mlp_table(args, bandwidth))
        return
    if not args.skip_shapes:
        console.print(shape_table(args, bandwidth))
    console.print(step_table(args, bandwidth))


if __name__ == "__main__":
    main()
