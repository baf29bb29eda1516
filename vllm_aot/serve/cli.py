"""`vllm-aot`: models, export, serve, cache, validate, tensors, demo."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.serve import cache_cli


def resolve_model(name: str | None) -> Path:
    """A model argument -> HF directory: a path, or the bundled default (prepared on first use)."""
    if name in (None, "", DEFAULT_MODEL_NAME, "default"):
        from vllm_aot.models.prepare import prepare_default_model

        return prepare_default_model()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise SystemExit(
            f"error: model {name!r} is neither a directory nor the bundled {DEFAULT_MODEL_NAME}; "
            "vllm-aot never downloads from a hub"
        )
    return path


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def add_config_args(parser: argparse.ArgumentParser, *, backend: str = "inductor") -> None:
    g = parser.add_argument_group("compiled shapes")
    g.add_argument("--batch-size", type=int, default=32, help="max sequences per decode step")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="largest prefill chunk")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--backend", default=backend, choices=["inductor", "eager"])
    g.add_argument("--decode-batch-buckets", type=_int_list, default=())
    g.add_argument("--decode-context-buckets", type=_int_list, default=(), help="tokens")
    g.add_argument("--prefill-token-buckets", type=_int_list, default=())
    g.add_argument("--prefill-context-buckets", type=_int_list, default=(), help="tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None)


def config_from_args(args: argparse.Namespace):
    from vllm_aot.runtime.config import RuntimeConfig

    try:
        return RuntimeConfig(
            max_num_seqs=args.batch_size,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            backend=args.backend,
            decode_batch_buckets=args.decode_batch_buckets,
            decode_context_buckets=args.decode_context_buckets,
            prefill_token_buckets=args.prefill_token_buckets,
            prefill_context_buckets=args.prefill_context_buckets,
            num_kv_blocks=args.num_kv_blocks,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc


def cmd_models(args: argparse.Namespace) -> int:
    from vllm_aot.models.registry import supported_architectures

    if args.action == "prepare":
        from vllm_aot.models.prepare import prepare_default_model

        print(prepare_default_model(force=args.force))
        return 0
    print("supported architectures:", ", ".join(supported_architectures()))
    print(f"bundled model: {DEFAULT_MODEL_NAME} (prepare it with `vllm-aot models prepare`)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from vllm_aot.runtime.artifacts import export_model

    config = config_from_args(args)
    model_dir = resolve_model(args.model)
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
    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
    from vllm_aot.models.registry import load_arch
    from vllm_aot.runtime.loader import LoadReport, check_fits, ensure_programs

    arch = load_arch(model_dir)
    check_fits(arch, config)
    cache = ProgramCache(
        CacheSettings.from_env(remote_url=args.remote_cache, upload=args.cache_upload or None)
    )
    report = LoadReport()
    start = time.perf_counter()
    ensure_programs(arch, config, report, cache=cache, num_workers=args.workers)
    print(
        f"{len(report.sources)} programs in {cache.local.root}: {report.count('local')} were "
        f"cached, {report.count('remote')} fetched, {report.count('compiled')} compiled "
        f"({sum(report.compiled.values()):.0f} s of compile) in {time.perf_counter() - start:.0f} s"
    )
    return 0


def _load(args: argparse.Namespace):
    from vllm_aot.runtime.artifacts import is_artifact_dir, load_artifact
    from vllm_aot.runtime.loader import load_model

    model_dir = resolve_model(args.model)
    if is_artifact_dir(model_dir):
        return model_dir, *load_artifact(model_dir)
    return model_dir, *load_model(model_dir, config_from_args(args))


DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "Give me three tips for staying focused.",
)


def cmd_demo(args: argparse.Namespace) -> int:
    """Generate chat answers through the runtime (what `serve` runs until the plugin lands)."""
    from transformers import AutoTokenizer

    from vllm_aot.runtime.generate import GenerationRequest, Generator
    from vllm_aot.runtime.sampler import SamplingParams

    model_dir, model, report = _load(args)
    print(f"model ready: {report.summary()}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
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


def cmd_validate(args: argparse.Namespace) -> int:
    """Teacher-forced logits and greedy output against HF transformers; exit 1 on failure."""
    from vllm_aot.accuracy.cli import run_validate

    model_dir, model, report = _load(args)
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
    from vllm_aot.accuracy import cli as accuracy

    if args.action == "compare":
        return accuracy.run_compare(args.ours, args.reference, tolerance=args.rtol)
    model_dir, model, report = _load(args)
    print(f"model ready: {report.summary()}", flush=True)
    common = dict(
        prompt_index=args.prompt,
        num_tokens=args.num_tokens,
        prompts_file=args.prompts,
        tolerance=args.rtol,
    )
    if args.action == "kv":
        return accuracy.run_kv(model_dir, model, **common)
    patterns, replace = args.pattern or (), args.replace or ()
    return accuracy.run_capture(
        model_dir, model, out_dir=args.out, patterns=patterns, replace=replace, **common
    )


def cmd_serve(args: argparse.Namespace, vllm_args: list[str]) -> int:
    """vLLM's OpenAI server on our platform (N replicas behind a proxy with
    --data-parallel-size); unknown flags go to vLLM unchanged."""
    from vllm_aot.serve.launch import run_serve

    return run_serve(args, vllm_args, resolve_model(args.model))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("configuration (default: exported dir, else defaults)")
    g.add_argument("--batch-size", type=int, default=None, help="max sequences per step")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="only 1 is supported")
    g = parser.add_argument_group("data parallelism")
    g.add_argument("--data-parallel-size", type=int, default=1, help="replicas behind a proxy")
    g.add_argument("--cores", default=None, help="cores to split among replicas, e.g. 0-3,8-11")
    g.add_argument("--max-restarts", type=int, default=3, help="per replica, in a row")
    g.add_argument("--start-timeout", type=float, default=900.0, help="seconds")
    g.add_argument("--replica-log-dir", default=None, help="replica-N.log files (default: ours)")
    g = parser.add_argument_group("proxy (data-parallel-size > 1)")
    g.add_argument("--proxy-max-body-mb", type=int, default=32, help="request body limit")
    g.add_argument("--proxy-connect-timeout", type=float, default=5.0, help="seconds")
    g.add_argument("--proxy-read-timeout", type=float, default=600.0, help="seconds of silence")
    g.add_argument("--proxy-health-interval", type=float, default=2.0, help="seconds")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--remote-cache",
        help="shared store of compiled programs: file:///dir or s3://bucket/prefix "
        "(default: VLLM_AOT_REMOTE_CACHE)",
    )
    parser.add_argument(
        "--cache-upload", action="store_true", help="upload what this process compiles"
    )


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
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--require-cached", action="store_true", help="never compile; fail instead")
    add_serve_args(p)
    add_cache_args(p)
    p.set_defaults(func=cmd_serve, passes_unknown=True)

    cache_cli.add_parser(sub)

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
    (without `=`) and is not a directory goes back behind that flag.
    """
    model = getattr(args, "model", None)
    if model is None or model not in argv or Path(model).exists():
        return
    before = argv[argv.index(model) - 1] if argv.index(model) > 0 else ""
    if before.startswith("--") and "=" not in before and before in unknown:
        unknown.insert(unknown.index(before) + 1, model)
        args.model = None


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
