"""The accuracy commands' bodies: `vllm-aot validate` and `vllm-aot tensors capture|compare|kv`.

`add_parsers` declares the arguments; the commands load the model (`args.load_from_args`) and the
`run_*` bodies do the rest and return the exit code (0 pass, 1 fail), so CI can use them as
they are.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_aot.cli.args import add_config_args, load_from_args, run_on_ranks
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import ProgramKey


def load_sequences(model_dir: Path, prompts_file: Path | None, reference, num_tokens: int):
    """The chat prompts (or one user message per line of `prompts_file`), each followed by HF
    fp32's greedy continuation of `num_tokens` tokens: (prompt ids, teacher-forced sequences)."""
    from vllm_aot.accuracy.logits import teacher_forcing_sequences
    from vllm_aot.accuracy.prompts import CHAT_PROMPTS, chat_prompt_token_ids

    messages = CHAT_PROMPTS
    if prompts_file is not None:
        lines = (line.strip() for line in prompts_file.read_text().splitlines())
        messages = tuple(m for m in lines if m)
        if not messages:
            raise SystemExit(f"error: {prompts_file} has no prompts")
    prompts = chat_prompt_token_ids(model_dir, messages)
    return prompts, teacher_forcing_sequences(reference, prompts, num_tokens)


def _print_table(console, rows: Sequence[Sequence[str]], title: str) -> None:
    from rich.table import Table

    header, *body = rows
    table = Table(*header, title=title)
    for row in body:
        table.add_row(*row)
    console.print(table)


def _coverage(
    prompts: Sequence[Sequence[int]],
    sequences: Sequence[Sequence[int]],
    runs_before: Mapping[ProgramKey, int],
    runs_after: Mapping[ProgramKey, int],
) -> str:
    """Which positions came from which programs, and the layer programs a validation ran."""
    num_prompt = sum(len(p) for p in prompts)
    num_continuation = sum(len(s) for s in sequences) - num_prompt
    ran = [key for key, count in runs_after.items() if count > runs_before.get(key, 0)]
    programs = ", ".join(
        f"{key.name} x{runs_after[key] - runs_before.get(key, 0)}"
        for key in sorted(ran)
        if key.is_layer
    )
    return (
        f"positions: {num_prompt} prompt (prefill programs), {num_continuation} continuation "
        f"(decode programs); layer programs run: {programs}"
    )


def run_validate(
    model_dir: Path,
    model: CompiledModel,
    *,
    prompts_file: Path | None,
    num_tokens: int,
    tolerance_overrides: Sequence[str] = (),
    report_path: Path | None = None,
) -> int:
    """Teacher-forced logits (three-way below fp32) and, in fp32, greedy output against HF
    (required equal unless the KV cache is fp8, whose logits have their own tolerances)."""
    from rich.console import Console

    from vllm_aot.accuracy.logit_tolerance import default_tolerances, parse_tolerances
    from vllm_aot.accuracy.logits import greedy_match, validate
    from vllm_aot.accuracy.quantized import simulation_for
    from vllm_aot.accuracy.teacher_forcing import HFReference

    kv_cache_dtype = model.config.kv_cache_dtype
    try:
        tolerances = parse_tolerances(tolerance_overrides, default_tolerances(kv_cache_dtype))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    console = Console()
    reference = HFReference(model_dir, simulation_for(model.arch, model.config))
    prompts, sequences = load_sequences(model_dir, prompts_file, reference, num_tokens)
    dtype = model.config.dtype
    three_way = dtype != "float32"
    runs_before = dict(model.num_executions)
    result = validate(
        model_dir,
        model,
        sequences,
        prompt_lengths=[len(p) for p in prompts],
        three_way=three_way,
        tolerances=tolerances,
        reference=reference,
    )
    title = f"teacher-forced logits, {dtype}" + (" (three-way)" if three_way else "")
    if kv_cache_dtype != "auto":
        title += f", KV cache {kv_cache_dtype} (its tolerances)"
    _print_table(console, result.summary_rows(), title)
    console.print(f"argmax agreement: {result.greedy_agreement:.1%}")
    coverage = _coverage(prompts, sequences, runs_before, model.num_executions)
    console.print(coverage)
    passed = result.passed
    backend = model.config.backend
    notes = [f"model {model_dir}, backend {backend}, {len(sequences)} prompts", coverage]
    if not three_way:
        matches = greedy_match(model_dir, model, prompts, num_tokens, reference=reference)
        num_match = sum(m.is_match for m in matches)
        line = f"greedy: first {num_tokens} tokens equal HF on {num_match}/{len(matches)}"
        if kv_cache_dtype != "auto":  # HF has no FP8 cache: its rounding flips near-ties
            line += f" (not required with a {kv_cache_dtype} KV cache)"
        console.print(line)
        notes.append(line)
        passed = passed and (num_match == len(matches) or kv_cache_dtype != "auto")
    if report_path is not None:
        from vllm_aot.accuracy.report import render_html

        report_title = f"vllm-aot validation: {Path(model_dir).name}, {dtype}"
        report_path.write_text(render_html(result, title=report_title, notes=notes))
        console.print(f"report: {report_path}")
    console.print("[bold green]PASSED" if passed else "[bold red]FAILED")
    return 0 if passed else 1


def run_capture(
    model_dir: Path,
    model: CompiledModel,
    *,
    out_dir: Path,
    patterns: Sequence[str],
    prompt_index: int,
    num_tokens: int,
    replace: Sequence[str] = (),
    prompts_file: Path | None = None,
    tolerance: float | None = None,
) -> int:
    """Capture ours and HF (in our dtype) for one teacher-forced prompt into out_dir/{ours,hf},
    print the comparison; exit 1 when a module diverges."""
    from vllm_aot.accuracy.capture import capture_hf, capture_ours, select
    from vllm_aot.accuracy.quantized import simulation_for
    from vllm_aot.accuracy.teacher_forcing import HFReference

    reference = HFReference(model_dir, simulation_for(model.arch, model.config))
    _, sequences = load_sequences(model_dir, prompts_file, reference, num_tokens)
    if not 0 <= prompt_index < len(sequences):
        raise SystemExit(f"error: --prompt {prompt_index}: choose 0..{len(sequences) - 1}")
    token_ids = sequences[prompt_index]
    hf_patterns = [*patterns, *replace] if patterns else []  # no patterns: everything
    hf = capture_hf(reference, token_ids, model.config.torch_dtype, hf_patterns)
    try:
        replacements = select(hf, replace)
        ours = capture_ours(model, token_ids, patterns, replacements=replacements)
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    ours.save(out_dir / "ours")
    hf.save(out_dir / "hf")
    print(f"captured {len(ours.tensors)} tensors of ours, {len(hf.tensors)} of HF into {out_dir}")
    return run_compare(out_dir / "ours", out_dir / "hf", tolerance=tolerance)


def run_compare(ours_dir: Path, reference_dir: Path, *, tolerance: float | None = None) -> int:
    """Compare two capture directories; exit 1 when a module diverges."""
    from rich.console import Console

    from vllm_aot.accuracy.capture import Capture
    from vllm_aot.accuracy.tensor_compare import compare_captures

    try:
        comparison = compare_captures(
            Capture.load(ours_dir), Capture.load(reference_dir), tolerance
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    console = Console()
    _print_table(console, comparison.summary_rows(), f"{ours_dir} vs {reference_dir}")
    if comparison.only_in_ours or comparison.only_in_reference:
        one_sided = [*comparison.only_in_ours, *comparison.only_in_reference]
        console.print(f"in one capture only (not compared): {', '.join(one_sided)}")
    console.print(comparison.verdict())
    return 0 if comparison.passed else 1


def run_kv(
    model_dir: Path,
    model: CompiledModel,
    *,
    prompt_index: int,
    num_tokens: int,
    prompts_file: Path | None = None,
    tolerance: float | None = None,
) -> int:
    """KV cache analysis of one teacher-forced prompt; exit 1 when a block is corrupted."""
    from rich.console import Console

    from vllm_aot.accuracy.kv_analysis import analyse_kv
    from vllm_aot.accuracy.quantized import simulation_for
    from vllm_aot.accuracy.teacher_forcing import HFReference

    reference = HFReference(model_dir, simulation_for(model.arch, model.config))
    _, sequences = load_sequences(model_dir, prompts_file, reference, num_tokens)
    if not 0 <= prompt_index < len(sequences):
        raise SystemExit(f"error: --prompt {prompt_index}: choose 0..{len(sequences) - 1}")
    report = analyse_kv(model, reference, sequences[prompt_index], tolerance=tolerance)
    console = Console()
    title = (
        f"KV cache vs HF past_key_values ({report.num_tokens} tokens, blocks {report.block_table})"
    )
    _print_table(console, report.summary_rows(), title)
    if report.passed:
        console.print(f"no block beyond {report.tolerance:g}")
    else:
        console.print(f"corrupted blocks: {', '.join(map(str, report.corrupted_blocks))}")
    return 0 if report.passed else 1


def cmd_validate(args: argparse.Namespace) -> int:
    """Teacher-forced logits and greedy output against HF transformers; exit 1 on failure. On
    several tensor-parallel ranks each computes the full logits (its head's are gathered), and
    rank 0 reports."""
    return run_on_ranks(_validate, args)


def _validate(args: argparse.Namespace) -> int:
    model_dir, model, report = load_from_args(args)
    print(f"model ready: {report.summary()}", flush=True)
    return run_validate(
        model_dir,
        model,
        prompts_file=args.prompts,
        num_tokens=args.num_tokens,
        tolerance_overrides=args.tolerance or (),
        report_path=args.report,
    )


def cmd_tensors(args: argparse.Namespace) -> int:
    """Tensor capture/compare and KV cache analysis against HF; exit 1 on a divergence."""
    if args.action == "compare":
        return run_compare(args.ours, args.reference, tolerance=args.rtol)
    return run_on_ranks(_tensors, args)


def _tensors(args: argparse.Namespace) -> int:
    model_dir, model, report = load_from_args(args)
    print(f"model ready: {report.summary()}", flush=True)
    common = dict(
        prompt_index=args.prompt,
        num_tokens=args.num_tokens,
        prompts_file=args.prompts,
        tolerance=args.rtol,
    )
    if args.action == "kv":
        return run_kv(model_dir, model, **common)
    patterns, replace = args.pattern or (), args.replace or ()
    return run_capture(
        model_dir, model, out_dir=args.out, patterns=patterns, replace=replace, **common
    )


def add_parsers(sub) -> None:
    """`validate` and `tensors capture | kv | compare`."""
    p = sub.add_parser("validate", help="logit validation against HF transformers")
    p.add_argument("model", nargs="?", help="HF or exported directory (default: bundled)")
    p.add_argument("--prompts", type=Path, help="file with one user message per line")
    p.add_argument("--num-tokens", type=int, default=32, help="HF continuation to teacher-force")
    p.add_argument(
        "--tolerance",
        action="append",
        metavar="SLICE=RTOL[:ATOL]",
        help="override a slice's tolerance, e.g. top5=0.02 or all=0.05:1e-5 (repeatable)",
    )
    p.add_argument("--report", type=Path, help="write an HTML report (table and plot) here")
    add_config_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("tensors", help="tensor capture/compare and KV cache analysis against HF")
    actions = p.add_subparsers(dest="action", required=True)
    for action, text in (
        ("capture", "capture module outputs of ours and HF for one prompt, then compare"),
        ("kv", "rebuild a prompt's K/V from the paged pool and compare with HF's cache"),
    ):
        a = actions.add_parser(action, help=text)
        a.add_argument("model", nargs="?", help="HF or exported directory (default: bundled)")
        a.add_argument("--prompt", type=int, default=0, help="index of the prompt to feed")
        a.add_argument("--prompts", type=Path, help="file with one user message per line")
        a.add_argument("--num-tokens", type=int, default=32, help="HF continuation to feed")
        a.add_argument("--rtol", type=float, default=None, help="relative L-inf tolerance")
        if action == "capture":
            a.add_argument("-o", "--out", type=Path, required=True, help="capture directory")
            a.add_argument("--pattern", action="append", help="module names (fnmatch; repeatable)")
            a.add_argument("--replace", action="append", help="run ours with HF's output here")
        add_config_args(a, backend="eager")
        a.set_defaults(func=cmd_tensors)
    a = actions.add_parser("compare", help="compare two capture directories")
    a.add_argument("ours", type=Path)
    a.add_argument("reference", type=Path)
    a.add_argument("--rtol", type=float, default=None, help="relative L-inf tolerance")
    a.set_defaults(func=cmd_tensors)
