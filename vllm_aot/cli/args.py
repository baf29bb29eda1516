"""Arguments shared by the `vllm-aot` commands: the model, the compiled shapes, the cache, serve's
configuration; and the one way a command loads a model from them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from vllm_aot.models.embedding_model import EMBEDDING_MODEL_NAME
from vllm_aot.models.prepare import DEFAULT_MODEL_NAME
from vllm_aot.runtime.options import OPTIONS, Option
from vllm_aot.serve.connections import ConnectionLimits

# serve flags given their default when left out (the others: None, so a choice can fill them).
_SERVE_DEFAULTED = ("tensor_parallel_size", "backend")
_SERVE_NOTES = {
    "quantization": "; for the bundled model, gguf unless --dtype is given",
    "tensor_parallel_size": "; vLLM's executor runs one worker each",
}


def resolve_model(name: str | None, cache=None) -> Path:
    """A model argument -> HF directory or `.gguf` file: a path, or the bundled default
    (prepared on first use: fetched from `cache`'s remote store when it has it, else converted;
    uploaded when `cache` uploads; default: the cache the environment names)."""
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
    from vllm_aot.models.gguf_config import is_gguf_file  # imports gguf: ~1 s, only for a path

    path = Path(name).expanduser()
    if not path.is_dir() and not (path.is_file() and is_gguf_file(path)):
        raise SystemExit(
            f"error: model {name!r} is neither a directory, a .gguf file nor a bundled model "
            f"({DEFAULT_MODEL_NAME}, {EMBEDDING_MODEL_NAME}); vllm-aot never downloads from a hub"
        )
    if path.is_file():
        refuse_unservable_gguf(path)
    return path


def refuse_unservable_gguf(path: Path) -> None:
    """SystemExit naming what is supported for a `.gguf` whose architecture, rotary scaling or
    tensor types we do not run: at the command's start, before any server or engine."""
    import torch

    from vllm_aot.models.checkpoints import resolve_weight_formats

    try:
        resolve_weight_formats(path, "gguf", torch.float32)
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"error: vllm-aot cannot serve {path}: {exc}") from None


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def _add_option(group, option: Option, default, note: str = "") -> None:
    """`option`'s command flag: a switch, a list of integers, one of its choices, or an integer."""
    shown = f"{option.help} (default: {default})" if default not in (None, ()) else option.help
    shown += note
    if isinstance(option.default, bool):
        group.add_argument(option.cli_flag, action="store_true", help=option.help)
    elif isinstance(option.default, tuple):
        group.add_argument(option.cli_flag, type=int_list, default=default, help=option.help)
    elif option.choices:
        group.add_argument(option.cli_flag, default=default, choices=option.choices, help=shown)
    else:
        group.add_argument(option.cli_flag, type=int, default=default, help=shown)


def add_config_args(parser: argparse.ArgumentParser, *, backend: str = "inductor") -> None:
    """Every compiled-shape option with a command flag, at its default (`runtime/options.py`)."""
    g = parser.add_argument_group("compiled shapes")
    for option in OPTIONS:
        if option.cli_flag and option.is_runtime:
            _add_option(g, option, backend if option.name == "backend" else option.default)


def config_from_args(args: argparse.Namespace):
    from vllm_aot.runtime.config import RuntimeConfig

    fields = {o.name: getattr(args, o.dest) for o in OPTIONS if o.cli_flag and o.is_runtime}
    try:
        return RuntimeConfig(**fields)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "configuration (default: exported dir, else the cache registry's, else defaults)"
    )
    for option in OPTIONS:
        if option.serve:  # not given: None, and the exported dir, registry or defaults decide
            default = option.default if option.name in _SERVE_DEFAULTED else None
            _add_option(g, option, default, _SERVE_NOTES.get(option.name, ""))
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
    limits = ConnectionLimits()
    g.add_argument(
        "--proxy-max-connections",
        type=int,
        default=limits.max_connections,
        help="client connections at once (at most what the open-file limit holds); a new one "
        "takes the place of the one idle longest, or gets 503 where all are busy "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--proxy-max-connections-per-client",
        type=int,
        default=limits.max_connections_per_client,
        help="client connections at once from one address, as above (default: %(default)s)",
    )
    g.add_argument(
        "--proxy-header-timeout",
        type=float,
        default=limits.header_timeout,
        help="seconds a new connection has to send a whole request header (default: %(default)s)",
    )
    g.add_argument(
        "--proxy-keepalive-timeout",
        type=float,
        default=limits.keepalive_timeout,
        help="seconds a kept-alive connection may stay idle between requests "
        "(default: %(default)s)",
    )
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
    from vllm_aot.loading.export_dir import is_artifact_dir
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
