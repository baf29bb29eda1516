"""Runtime benchmark: compile, load, prefill and decode speed of SmolLM2 vs HF transformers eager.

Prints, in one run on this machine: compile seconds per program and in total, load time of the
exported directory, prefill tokens/s, decode tokens/s at batch 1, 8 and 32, and the same figures
for HF transformers (eager, same dtype) with our/HF ratios.

    .venv/bin/python bench/runtime_bench.py [--dtype bfloat16] [--quantization gguf|int8]
                                            [--artifact DIR] [--steps 32]

Also the batch-1 decode step's time beside the time reading its weights once would take at
this machine's measured read bandwidth (`machine.py`): the share of the bandwidth it reaches.

--artifact reuses (or creates) an exported directory; without it, the export goes to a fresh
temporary directory so compile time is measured from scratch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import read_bandwidth_gbs
from rich.console import Console
from rich.table import Table

from vllm_aot.loading.export_dir import export_model, is_artifact_dir
from vllm_aot.loading.startup import load_model
from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.runtime.config import QUANTIZATIONS, RuntimeConfig
from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.kv_cache import BlockAllocator, blocks_needed
from vllm_aot.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0).normalized()
PROMPT_LEN = 128
BATCHES = (1, 8, 32)


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt) % 40000 + 100 for i in range(n)]


def time_ours_prefill(model, num_tokens: int, repeats: int) -> float:
    allocator = BlockAllocator(model.config.total_kv_blocks)
    blocks = allocator.allocate(blocks_needed(num_tokens, model.config.block_size))
    chunk = PrefillChunk(tokens(num_tokens), 0, blocks)
    row = [RowSampling(GREEDY, 0, num_tokens)]
    model.prefill([chunk], row)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.prefill([chunk], row)
        times.append(time.perf_counter() - start)
    return num_tokens / statistics.median(times)


def time_ours_decode(model, batch: int, steps: int) -> float:
    config = model.config
    allocator = BlockAllocator(config.total_kv_blocks)
    tables = [
        allocator.allocate(blocks_needed(PROMPT_LEN + steps + 2, config.block_size))
        for _ in range(batch)
    ]
    # Fill the caches with one packed prefill per group of prompts that fits a chunk.
    per_step = max(1, config.max_num_batched_tokens // PROMPT_LEN)
    for start in range(0, batch, per_step):
        group = range(start, min(batch, start + per_step))
        chunks = [PrefillChunk(tokens(PROMPT_LEN, i), 0, tables[i]) for i in group]
        model.prefill(chunks, [RowSampling(GREEDY, 0, PROMPT_LEN)] * len(chunks))
    last = [1] * batch
    elapsed = 0.0
    for step in range(steps + 1):
        position = PROMPT_LEN + step
        rows = [DecodeRow(last[i], position, tables[i]) for i in range(batch)]
        start = time.perf_counter()
        out = model.decode(rows, [RowSampling(GREEDY, 0, position + 1)] * batch)
        if step > 0:  # step 0 is the warm-up
            elapsed += time.perf_counter() - start
        last = out.tokens.tolist()
    return batch * steps / elapsed


def time_hf(model_dir: Path, dtype: torch.dtype, steps: int, prefill_len: int, repeats: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    results = {}
    with torch.no_grad():
        ids = torch.tensor([tokens(prefill_len)])
        hf(ids)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            hf(ids)
            times.append(time.perf_counter() - start)
        results["prefill"] = prefill_len / statistics.median(times)
        for batch in BATCHES:
            ids = torch.tensor([tokens(PROMPT_LEN, i) for i in range(batch)])
            out = hf(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            elapsed = 0.0
            for step in range(steps + 1):
                start = time.perf_counter()
                out = hf(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                if step > 0:
                    elapsed += time.perf_counter() - start
            results[f"decode_b{batch}"] = batch * steps / elapsed
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    parser.add_argument("--artifact", type=Path, help="exported directory to reuse or create")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    console = Console()
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))

    model_dir = prepare_default_model()
    config = RuntimeConfig(
        dtype=args.dtype,
        quantization=args.quantization,
    )
    with tempfile.TemporaryDirectory(prefix="vllm-aot-bench-") as tmp:
        artifact = args.artifact or Path(tmp) / "smollm2"
        compile_seconds, export_wall = {}, 0.0
        if not is_artifact_dir(artifact):
            console.print(f"exporting {model_dir.name} ({args.dtype}) to {artifact} ...")
            report = export_model(model_dir, artifact, config)
            compile_seconds, export_wall = report.compile_seconds, report.total_seconds
        start = time.perf_counter()
        model, load_report = load_model(artifact, config)
        load_seconds = time.perf_counter() - start
        weights = model.config.formats_summary()  # gguf: the formats read from the file

        ours = {"prefill": time_ours_prefill(model, args.prefill_len, args.repeats)}
        for batch in BATCHES:
            ours[f"decode_b{batch}"] = time_ours_decode(model, batch, args.steps)
        del model
    hf = time_hf(model_dir, config.torch_dtype, args.steps, args.prefill_len, args.repeats)

    if compile_seconds:
        table = Table(title="compile seconds per program (2 workers in parallel)")
        table.add_column("program")
        table.add_column("seconds", justify="right")
        for name, secs in sorted(compile_seconds.items()):
            table.add_row(name, f"{secs:.1f}")
        console.print(table)
        console.print(
            f"compile: {len(compile_seconds)} programs, {sum(compile_seconds.values()):.0f} s "
            f"of compile work, export wall time {export_wall:.0f} s"
        )
    console.print(
        f"load of the exported directory: {load_seconds:.2f} s "
        f"({len(load_report.loaded)} programs in {sum(load_report.loaded.values()):.2f} s, "
        f"weights {load_report.weights_bytes / 1e6:.0f} MB in {load_report.weights_seconds:.2f} s)"
    )
    bandwidth = read_bandwidth_gbs()
    step_ms = 1000 / ours["decode_b1"]
    floor_ms = load_report.weights_bytes / bandwidth / 1e6
    console.print(
        f"batch-1 decode step: {step_ms:.2f} ms; its weights ({load_report.weights_bytes / 1e6:.0f}"
        f" MB, {weights}) read once at the measured {bandwidth:.1f} GB/s take "
        f"{floor_ms:.2f} ms: the step reads them at {100 * floor_ms / step_ms:.0f} % of the "
        "bandwidth"
    )
    table = Table(
        title=f"SmolLM2-135M-Instruct, {args.dtype}, {weights}, tokens/s (higher is better)"
    )
    for column in ("measure", "vllm-aot", "HF eager", "ratio"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    labels = {"prefill": f"prefill, {args.prefill_len}-token prompt"}
    labels |= {f"decode_b{b}": f"decode, batch {b} (ctx {PROMPT_LEN}+)" for b in BATCHES}
    for key, label in labels.items():
        table.add_row(label, f"{ours[key]:.1f}", f"{hf[key]:.1f}", f"{ours[key] / hf[key]:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
