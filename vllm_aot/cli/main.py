"""`vllm-aot`: models, export, serve, cache, validate, tensors, demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from vllm_aot.cli import accuracy
from vllm_aot.cli import cache as cache_cli
from vllm_aot.cli.args import (
    add_cache_args,
    add_config_args,
    add_serve_args,
    cache_from_args,
    config_from_args,
    load_from_args,
    resolve_model,
    run_on_ranks,
)
from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME


def cmd_models(args: argparse.Namespace) -> int:
    from vllm_aot.models.registry import supported_architectures

    if args.action == "prepare" and args.force:
        from vllm_aot.models.prepare import prepare_default_model

        print(prepare_default_model(force=True))
        return 0
    if args.action == "prepare":
        print(resolve_model(None))
        return 0
    print("supported architectures:", ", ".join(supported_architectures()))
    print(f"bundled model: {DEFAULT_MODEL_NAME} (prepare it with `vllm-aot models prepare`)")
    print(f"bundled embedding model: {EMBEDDING_MODEL_NAME} (`vllm-aot serve --runner pooling`)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from vllm_aot.loading.export_dir import export_model

    model_dir = resolve_model(args.model, cache_from_args(args))
    config = config_from_args(args)
    if args.compile_only:
        return _compile_only(model_dir, config, args)
    if args.output is None:
        raise SystemExit("error: export needs -o/--output DIR (or --compile-only)")
    report = export_model(
        model_dir, args.output, config, copy_weights=args.copy_weights, num_workers=args.workers
    )
    compiled = report.compile_seconds
    print(
        f"exported {model_dir.name} to {report.out_dir}: {len(compiled)} programs compiled "
        f"({sum(compiled.values()):.0f} s of compile), {report.total_seconds:.0f} s in total"
    )
    return 0


def _compile_only(model_dir: Path, config, args: argparse.Namespace) -> int:
    """Fill the compile cache (and the registry) for `config`; load no weights."""
    from vllm_aot.loading.program_sources import (
        LoadReport,
        ProgramOptions,
        check_fits,
        ensure_programs,
        with_checkpoint_formats,
    )
    from vllm_aot.loading.progress import seconds_by_group
    from vllm_aot.models.source import load_arch
    from vllm_aot.runtime.programs import all_program_keys

    arch = load_arch(model_dir)
    config = with_checkpoint_formats(config, model_dir)  # a GGUF's formats, from its file
    check_fits(arch, config)
    cache = cache_from_args(args)
    report = LoadReport()
    start = time.perf_counter()
    ensure_programs(arch, config, report, ProgramOptions(cache=cache, num_workers=args.workers))
    print(
        f"{len(report.sources)} programs in {cache.local.root}: {report.count('local')} were "
        f"cached, {report.count('remote')} fetched, {report.count('compiled')} compiled "
        f"({sum(report.compiled.values()):.0f} s of compile) in {time.perf_counter() - start:.0f} s"
    )
    if report.compiled:
        by_group = seconds_by_group(report.compiled, all_program_keys(config))
        print(f"compile seconds by group: {by_group}")
    return 0


DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "Give me three tips for staying focused.",
)


def cmd_demo(args: argparse.Namespace) -> int:
    """Chat answers through the runtime's generate loop, without a server (on
    `--tensor-parallel-size` ranks of this machine when asked)."""
    return run_on_ranks(_demo, args)


def _demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_aot.models.source import tokenizer_dir
    from vllm_aot.runtime.generate import GenerationRequest, Generator
    from vllm_aot.runtime.sampler import SamplingParams

    model_dir, model, report = load_from_args(args)
    print(f"model ready: {report.summary()}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
    prompts = args.prompt or list(DEMO_PROMPTS)
    requests = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        requests.append(
            GenerationRequest(
                tokenizer(ids, add_special_tokens=False)["input_ids"],
                max_tokens=args.max_tokens,
                sampling=SamplingParams(temperature=args.temperature, seed=args.seed),
            )
        )
    generator = Generator(model, eos_token_ids=[tokenizer.eos_token_id])
    start = time.perf_counter()
    results = generator.generate(requests)
    seconds = time.perf_counter() - start
    for prompt, result in zip(prompts, results, strict=True):
        print(f"\n>>> {prompt}\n{tokenizer.decode(result.token_ids, skip_special_tokens=True)}")
    num_tokens = sum(len(r.token_ids) for r in results)
    print(f"\n{num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.1f} tok/s)")
    return 0


def cmd_serve(args: argparse.Namespace, vllm_args: list[str]) -> int:
    """vLLM's OpenAI server on our platform (N replicas behind a proxy with
    --data-parallel-size); unknown flags go to vLLM unchanged."""
    from vllm_aot.loading.prebuilt import ensure_model_infos
    from vllm_aot.plugin.engine_flags import parse_vllm_flags
    from vllm_aot.serve.launch import run_serve

    cache = cache_from_args(args)
    if args.model is None and parse_vllm_flags(vllm_args).given.get("runner") == "pooling":
        args.model = EMBEDDING_MODEL_NAME  # the bundled embedding model, as the chat one otherwise
    model_dir = resolve_model(args.model, cache)
    ensure_model_infos(cache)  # spares vLLM inspecting the model class in a fresh interpreter
    return run_serve(args, vllm_args, model_dir)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-aot", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list supported models; prepare the bundled one")
    p.add_argument("action", nargs="?", choices=["list", "prepare"], default="list")
    p.add_argument("--force", action="store_true", help="convert the GGUF again")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("export", help="compile a model into an artifact directory")
    p.add_argument("model", nargs="?", help=f"HF directory (default: {DEFAULT_MODEL_NAME})")
    p.add_argument("-o", "--output", type=Path, help="artifact directory to write")
    p.add_argument("--copy-weights", action="store_true", help="make the directory self-contained")
    p.add_argument("--workers", type=int, default=None, help="parallel compile processes")
    p.add_argument(
        "--compile-only", action="store_true", help="only fill the compile cache (no -o needed)"
    )
    add_cache_args(p)
    add_config_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="OpenAI-compatible server (vLLM's) on the compiled runtime")
    p.add_argument("model", nargs="?", help="HF or exported directory (default: bundled)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--require-cached", action="store_true", help="never compile; fail instead")
    add_serve_args(p)
    add_cache_args(p)
    p.set_defaults(func=cmd_serve, passes_unknown=True)

    cache_cli.add_parser(sub)

    accuracy.add_parsers(sub)

    p = sub.add_parser("demo", help="chat completions through the runtime's generate loop")
    p.add_argument("model", nargs="?", help="HF or exported directory (default: bundled)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_config_args(p)
    p.set_defaults(func=cmd_demo)
    return parser


def reclaim_flag_value(argv: list[str], args, unknown: list[str]) -> None:
    """Give back a passed-through flag's value that argparse took for the model.

    `serve --profiler-config '{"profiler": "torch"}'`: argparse does not know vLLM's flag, so its
    value looks like the optional model positional. A value that follows an unknown `--flag`
    (without `=`) and is no path (or the file of `--config FILE.yaml`) goes back behind that flag,
    and a path argparse then left over (`serve --max-num-seqs 1 ./M.gguf`) is the model.
    """
    model = getattr(args, "model", None)
    if model is None or model not in argv:
        return
    before = argv[argv.index(model) - 1] if argv.index(model) > 0 else ""
    if Path(model).exists() and not (before == "--config" and Path(model).is_file()):
        return
    if before.startswith("--") and "=" not in before and before in unknown:
        unknown.insert(unknown.index(before) + 1, model)
        args.model = None
        left_over = [i for i, a in enumerate(unknown) if _is_positional_path(unknown, i)]
        if left_over:
            args.model = unknown.pop(left_over[0])


def _is_positional_path(unknown: list[str], i: int) -> bool:
    """Whether unknown[i] is an existing path that no unknown `--flag` before it takes as its
    value."""
    value, before = unknown[i], unknown[i - 1] if i else ""
    takes_it = before.startswith("--") and "=" not in before
    return not value.startswith("-") and Path(value).exists() and not takes_it


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "passes_unknown", False):
        reclaim_flag_value(argv, args, unknown)
        return args.func(args, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
