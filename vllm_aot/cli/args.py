"""Arguments shared by the `vllm-aot` commands: the model, the compiled shapes, the cache, serve's
configuration; and the one way a command loads a model from them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.runtime.config import KV_CACHE_ALIASES, KV_CACHE_DTYPES, QUANTIZATIONS


def resolve_model(name: str | None, cache=None) -> Path:
    """A model argument -> HF directory: a path, or the bundled default (prepared on first use:
    fetched from `cache`'s remote store when it has it, else converted; uploaded when `cache`
    uploads; default: the cache the environment names)."""
    if name in (None, "", DEFAULT_MODEL_NAME, "default"):
        from vllm_aot.loading.prebuilt import bundled_model

        cache = cache or cache_from_args(argparse.Namespace())
        model_dir, origin = bundled_model(cache)
        if origin != "local":
            how = {"remote": f"fetched from {cache.settings.remote_url}", "converted": "converted"}
            print(f"{DEFAULT_MODEL_NAME}: {how[origin]} into {model_dir}", flush=True)
        return model_dir
    if name == EMBEDDING_MODEL_NAME:
        from vllm_aot.models.embedding_model import prepare_embedding_model

        return prepare_embedding_model()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise SystemExit(
            f"error: model {name!r} is neither a directory nor a bundled model "
            f"({DEFAULT_MODEL_NAME}, {EMBEDDING_MODEL_NAME}); vllm-aot never downloads from a hub"
        )
    return path


def int_list(text: str) -> tuple[int, ...]:
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
    g.add_argument("--quantization", default=None, choices=QUANTIZATIONS)
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=[*KV_CACHE_DTYPES, *KV_CACHE_ALIASES],
        help="KV cache elements (auto: --dtype; fp8 is fp8_e4m3)",
    )
    g.add_argument("--backend", default=backend, choices=["inductor", "eager"])
    g.add_argument("--decode-batch-buckets", type=int_list, default=())
    g.add_argument("--decode-context-buckets", type=int_list, default=(), help="tokens")
    g.add_argument("--prefill-token-buckets", type=int_list, default=())
    g.add_argument("--prefill-context-buckets", type=int_list, default=(), help="tokens")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split over (here: one process each on this machine)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="an MoE model's experts split whole over the ranks (vLLM's flag)",
    )


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
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("configuration (default: exported dir, else defaults)")
    g.add_argument("--batch-size", type=int, default=None, help="max sequences per step")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="gguf: the model's .gguf blocks as they are (the bundled model's default); int8: "
        "every linear quantised at load (default: dense weights; for the bundled model, gguf "
        "unless --dtype is given)",
    )
    g.add_argument("--kv-cache-dtype", default=None, choices=[*KV_CACHE_DTYPES, *KV_CACHE_ALIASES])
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks each replica's model is split over (vLLM's executor runs one worker each)",
    )
    g = parser.add_argument_group("data parallelism")
    g.add_argument("--data-parallel-size", type=int, default=1, help="replicas behind a proxy")
    g.add_argument("--cores", default=None, help="cores to split among replicas, e.g. 0-3,8-11")
    g.add_argument("--max-restarts", type=int, default=3, help="per replica, in a row")
    g.add_argument("--start-timeout", type=float, default=900.0, help="seconds, restarts too")
    g.add_argument(
        "--replica-hang-timeout",
        type=float,
        default=30.0,
        help="seconds a replica may fail every health check before it is killed and restarted",
    )
    g.add_argument("--replica-log-dir", default=None, help="replica-N.log files (default: ours)")
    g = parser.add_argument_group("proxy (data-parallel-size > 1)")
    g.add_argument("--proxy-max-body-mb", type=int, default=32, help="request body limit")
    g.add_argument("--proxy-connect-timeout", type=float, default=5.0, help="seconds")
    g.add_argument("--proxy-read-timeout", type=float, default=600.0, help="seconds of silence")
    g.add_argument("--proxy-health-interval", type=float, default=2.0, help="seconds")
    g.add_argument(
        "--expose-metrics",
        action="store_true",
        help="/metrics without the API key (every other path but /health needs it)",
    )


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--remote-cache",
        help="shared store of compiled programs: file:///dir or s3://bucket/prefix "
        "(default: VLLM_AOT_REMOTE_CACHE)",
    )
    parser.add_argument(
        "--cache-upload", action="store_true", help="upload what this process compiles"
    )


def cache_from_args(args: argparse.Namespace):
    """The compile cache `--remote-cache` and `--cache-upload` name (else the environment)."""
    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache

    settings = CacheSettings.from_env(
        remote_url=getattr(args, "remote_cache", None),
        upload=getattr(args, "cache_upload", False) or None,
    )
    return ProgramCache(settings)


def load_from_args(args: argparse.Namespace):
    """(model directory, CompiledModel, LoadReport): an exported directory under its own
    configuration, else the model under the shape flags."""
    from vllm_aot.loading.artifacts import is_artifact_dir
    from vllm_aot.loading.startup import load_model

    model_dir = resolve_model(args.model)
    config = None if is_artifact_dir(model_dir) else config_from_args(args)
    return model_dir, *load_model(model_dir, config, rank=getattr(args, "rank", 0))


def run_on_ranks(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`command(args)` (a module-level function that loads the model with `load_from_args`) on
    `--tensor-parallel-size` ranks of this machine (`runtime/ranks.py`): every rank runs it
    whole, in step; rank 0's output and exit code are the command's."""
    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1:
        return command(args)
    from vllm_aot.runtime.ranks import run_ranks

    return run_ranks(_on_rank, size, command, args, quiet=True)[0]


def _on_rank(rank: int, command, args: argparse.Namespace) -> int:
    args.rank = rank
    return command(args)
