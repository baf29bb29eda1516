"""Speculative decoding A/B on a shared machine: ours with and without drafts, interleaved.

    .venv/bin/python bench/spec_bench.py [--cases copy,128x128] [--concurrency 1]
                                         [--rounds 3] [--serve-args "--max-num-seqs 8"]
                                         [--against ours-ngram|ours-sync]
                                         [--num-speculative-tokens K]

perf_bench runs one system after the other, so on a machine other people load the two systems
meet different loads. Here both servers (`perf_bench.server`'s `ours` and `--against`: n-gram
drafts, or no drafts but synchronous scheduling; the bundled GGUF, same shapes) are started
first and stay up; each round then runs every case once on each, alternating which goes first,
so both see the same load in turn. Prints each run's output tok/s, the per-case medians and the
ratio, and the drafts' acceptance per position over all rounds (vLLM's spec-decode counters).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

from copy_case import acceptance, case_args, spec_counters
from perf_bench import start
from serve_bench import run_vllm_bench

from vllm_aot.models.prepare import DEFAULT_MODEL_NAME, prepare_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="copy,128x128")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="requests per run")
    parser.add_argument("--serve-args", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--against", default="ours-ngram", choices=["ours-ngram", "ours-sync"])
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k: drafts a step")
    args = parser.parse_args()
    systems = ("ours", args.against)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="vllm-aot-spec-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model = prepare_default_model()
    cases = args.cases.split(",")
    tok_s: dict[tuple[str, str], list[float]] = {(s, c): [] for s in systems for c in cases}
    with contextlib.ExitStack() as stack:
        urls = {system: start(system, model, args, out_dir, stack).url for system in systems}
        before = spec_counters(urls[args.against])
        seed = 0
        for round_ in range(args.rounds):
            order = systems if round_ % 2 == 0 else systems[::-1]
            for case in cases:
                seed += 1
                for system in order:
                    input_len, output_len, extra = case_args(case, args.prompts, out_dir)
                    bench = SimpleNamespace(
                        input_len=input_len,
                        output_len=output_len,
                        num_prompts=args.prompts,
                        concurrency=args.concurrency,
                    )
                    tag = f"{system}-{case}-r{round_}"
                    r = run_vllm_bench(
                        urls[system], model, DEFAULT_MODEL_NAME, bench, out_dir, tag,
                        seed=seed, extra_args=extra,
                    )  # fmt: skip
                    tok_s[(system, case)].append(r["output_throughput"])
                    print(f"{tag}: {r['output_throughput']:.1f} tok/s", flush=True)
        print(f"drafts over all rounds: {acceptance(before, spec_counters(urls[args.against]))}")
    for case in cases:
        plain = statistics.median(tok_s[("ours", case)])
        spec = statistics.median(tok_s[(args.against, case)])
        print(
            f"{case} x{args.concurrency}: ours {plain:.1f} tok/s, {args.against} {spec:.1f} "
            f"tok/s (medians of {args.rounds}): {spec / plain:.2f}x"
        )
    print(f"results and logs in {out_dir}")


if __name__ == "__main__":
    main()
