"""AotOptions: our settings for one vLLM engine, resolved once from vLLM's configuration.

The options are `runtime/options.py`'s table. Sources, in order: an exported artifact directory
given as the model (its manifest fixes every shape; a flag contradicting it is refused); vLLM's
flags as the user gave them, read before vLLM fills in its own defaults (`plugin/engine_flags.py`:
`--max-num-seqs 128` is 128), and what vLLM decided (`VLLM_DECIDES`: the dtype, the quantization,
whose linears' formats are resolved here, from the model's .gguf for gguf, the runner, --convert,
the drafts of --speculative-config, TP and EP); `--additional-config` keys named like the options
(`backend`, `decode_batch_buckets`, `cache_dir`, `num_threads`, ...; one that a given flag also
sets must agree with it); otherwise our defaults (`RuntimeConfig`'s, and for the length the
model's limit where it is shorter). The platform resolves them once in the front-end process and
stores the result in `additional_config["vllm_aot"]`, which the engine, the scheduler and the
worker read (`AotOptions.of`); `vllm-aot serve` pins its choices with the same `pinned_fields`
and `check_artifact`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_aot.loading.export_dir import is_artifact_dir, read_manifest
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.placement import available_cores, split_front_end
from vllm_aot.plugin.engine_flags import GIVEN_KEY, given_in_config
from vllm_aot.plugin.front_end import front_end_nice
from vllm_aot.plugin.spec_decode import draft_model_path, num_speculative_tokens
from vllm_aot.runtime.config import RuntimeConfig, kv_cache_dtype_name
from vllm_aot.runtime.options import BY_NAME, ENGINE_OPTIONS, SPECULATIVE_FLAG

RESOLVED_KEY = "vllm_aot"
# Options vLLM decides (its flag, else its default or the model's): the runtime follows it, and
# `--additional-config` may only repeat its value.
VLLM_DECIDES = (
    "dtype",
    "quantization",
    "runner",
    "convert",
    "num_speculative_tokens",
    "tensor_parallel_size",
    "enable_expert_parallel",
)
_PARALLEL = ("tensor_parallel_size", "enable_expert_parallel")
# vLLM's --kv-cache-dtype values we run besides "auto" and the model's dtype ("fp8" = "fp8_e4m3").
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# An encoder's vLLM step holds up to this many of its largest encode programs: a request's whole
# batch of sentences in one step, packed together by `EncoderModel.steps`.
ENCODE_PROGRAMS_PER_STEP = 4


@dataclass(frozen=True)
class AotOptions:
    runtime: RuntimeConfig
    artifact_dir: Path | None = None  # the model is an exported directory: load, never compile
    cache_dir: str | None = None  # local compile cache (default: VLLM_AOT_COMPILE_CACHE or ~)
    remote_cache: str | None = None  # file:// or s3:// (default: VLLM_AOT_REMOTE_CACHE)
    cache_upload: bool | None = None  # push compiled programs (default: VLLM_AOT_CACHE_UPLOAD)
    require_cached: bool = False  # a missing program is an error instead of a compile
    stats_file: str | None = None  # where the worker reports start-up counters (see metrics.py)
    # The engine's torch threads (default: one per core of its affinity). Fewer can serve faster
    # where the cores are shared: a descheduled thread stalls its team at every parallel loop.
    num_threads: int | None = None
    # Speculative decoding's `method: draft_model` (`plugin/spec_decode.py`): the draft model's
    # path (None: no draft model).
    draft_model: str | None = None
    # The cores the front end runs on, resolved at start (`plugin/front_end.py`): the API
    # server and the engine's own threads there, the steps on the rest. Empty: shared.
    front_end_cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")

    def cache_settings(self):
        from vllm_aot.cache.program_cache import CacheSettings

        return CacheSettings.from_env(
            root=self.cache_dir, remote_url=self.remote_cache, upload=self.cache_upload
        )

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["runtime"] = self.runtime.to_dict()
        fields["artifact_dir"] = str(self.artifact_dir) if self.artifact_dir else None
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> AotOptions:
        fields = dict(fields)
        runtime = RuntimeConfig.from_dict(fields.pop("runtime"))
        artifact_dir = fields.pop("artifact_dir", None)
        fields["front_end_cores"] = tuple(fields.get("front_end_cores", ()))
        return cls(
            runtime=runtime, artifact_dir=Path(artifact_dir) if artifact_dir else None, **fields
        )

    @classmethod
    def of(cls, vllm_config) -> AotOptions:
        """The options the platform resolved for this engine's configuration."""
        return cls.from_dict(vllm_config.additional_config[RESOLVED_KEY])


def dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {name} is not supported by vllm-aot; supported: bfloat16, float32")
    return name


def _default_chunk(runner: str, max_model_len: int) -> int:
    """The largest prefill (encode) bucket when not given. Pooling steps may hold whole prompts
    (vLLM chunks no bidirectional or mean-pooled one), several to a bucket: at least one of
    max_model_len."""
    default = BY_NAME["max_num_batched_tokens"].default
    return min(default, max_model_len) if runner == "generate" else max(default, max_model_len)


def step_token_budget(runtime: RuntimeConfig) -> int:
    """The tokens vLLM may schedule in one step: the largest prefill or encode program's, or an
    encoder's `ENCODE_PROGRAMS_PER_STEP` of them (its runner splits a step into programs)."""
    is_encoder = runtime.runner == "pooling" and runtime.convert is None
    return runtime.max_num_batched_tokens * (ENCODE_PROGRAMS_PER_STEP if is_encoder else 1)


def flag_text(name: str) -> str:
    """How a command line gives option `name`: its vLLM flag, else --additional-config's key."""
    flag = BY_NAME[name].vllm_flag
    if flag == SPECULATIVE_FLAG:
        return f"{flag} {name}"
    return flag or f"--additional-config {name}"


def _normal(name: str, value: Any, dtype: str | None) -> Any:
    """An option's value as RuntimeConfig holds it; None for one that means "not given" (a KV
    cache dtype of "auto" or the model's dtype)."""
    if name == "dtype":
        return dtype_name(value)
    if name == "kv_cache_dtype":
        return None if value in ("auto", dtype) else kv_cache_dtype_name(value)
    if name.endswith("_buckets") or name == "weight_formats":
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def pinned_fields(
    given: dict[str, Any], extra: dict[str, Any], dtype: str | None = None
) -> dict[str, Any]:
    """The RuntimeConfig fields a command line fixes: vLLM's flags the user gave (`given`, option
    name -> value) and `--additional-config`'s (`extra`), normalised; ValueError where the two
    disagree. `dtype` is the model's (a KV cache dtype equal to it is "auto")."""
    pinned: dict[str, Any] = {}
    for source in (given, extra):
        for name, value in source.items():
            if not BY_NAME[name].is_runtime:
                continue
            value = _normal(name, value, dtype)
            if value is None:
                continue
            if pinned.setdefault(name, value) != value:
                raise ValueError(
                    f"{flag_text(name)} {given[name]} contradicts --additional-config {name} "
                    f"{extra[name]!r}; give one"
                )
    return pinned


def check_artifact(
    model: str | None, runtime: RuntimeConfig, asked: dict[str, Any], extra: dict[str, Any]
) -> None:
    """ValueError naming every option in `asked` (pinned fields) that exported directory `model`
    (compiled for `runtime`) contradicts, or `--additional-config` shapes (`extra`)."""
    where = f"the exported directory {model}" if model else "the exported directory"
    conflicts = [
        f"{flag_text(name)} {value} (it was compiled for {getattr(runtime, name)})"
        for name, value in asked.items()
        if value != getattr(runtime, name)
    ]
    if conflicts:
        raise ValueError(
            f"{where} fixes its shapes; these flags contradict it: {'; '.join(conflicts)}. "
            "Drop them, or export again with the configuration you need."
        )
    shapes = sorted(name for name in extra if name in BY_NAME and BY_NAME[name].is_runtime)
    if shapes:
        raise ValueError(
            f"{where} fixes its shapes; remove {', '.join(shapes)} from --additional-config"
        )


def _split_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """--additional-config as (RuntimeConfig fields, engine options); ValueError naming unknown
    keys. Keys vLLM itself puts there (other than ours) are not the user's."""
    extra = {k: v for k, v in extra.items() if k != RESOLVED_KEY}
    unknown = sorted(set(extra) - set(BY_NAME))
    if unknown:
        raise ValueError(
            f"unknown vllm-aot option(s) in --additional-config: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(BY_NAME))}"
        )
    engine = {k: extra.pop(k) for k in ENGINE_OPTIONS if k in extra}
    return extra, engine


def resolve_options(
    *,
    model: str,
    given: dict[str, Any],
    vllm: dict[str, Any],
    extra: dict[str, Any],
    decided: dict[str, Any] | None = None,
) -> AotOptions:
    """Decide an engine's options (see the module docstring for precedence). `given`: vLLM's
    flags the user gave (option name -> value, before vLLM's defaults); `vllm`: vLLM's values of
    `VLLM_DECIDES` and `max_model_len` (the length it allows: the given one, else the model's);
    `extra`: --additional-config; `decided`: engine options the platform fixed (stats file,
    draft model, front-end cores)."""
    extra, engine = _split_extra(extra)
    engine |= decided or {}
    decides = {name: vllm[name] for name in VLLM_DECIDES}
    decides["dtype"] = dtype_name(decides["dtype"])
    user = {k: v for k, v in given.items() if k not in VLLM_DECIDES}
    fields = pinned_fields(user, extra, decides["dtype"])
    if is_artifact_dir(model):
        runtime = RuntimeConfig.from_dict(read_manifest(model)["config"])
        asked = pinned_fields(given, {}, decides["dtype"])
        asked |= {k: decides[k] for k in ("num_speculative_tokens", *_PARALLEL)}
        check_artifact(model, runtime, asked, extra)
        return AotOptions(runtime=runtime, artifact_dir=Path(model), **engine)
    for name, value in decides.items():
        if fields.setdefault(name, value) != value:
            raise ValueError(
                f"--additional-config sets {name} {fields[name]!r}; {flag_text(name)} asks "
                f"{value!r} (give it there)"
            )
    fields.setdefault("max_model_len", min(vllm["max_model_len"], BY_NAME["max_model_len"].default))
    fields.setdefault(
        "max_num_batched_tokens", _default_chunk(fields["runner"], fields["max_model_len"])
    )
    if fields["quantization"] and not fields.get("weight_formats"):
        dtype = RuntimeConfig(dtype=fields["dtype"]).torch_dtype
        fields.update(resolve_weight_formats(model, fields["quantization"], dtype)._asdict())
    return AotOptions(runtime=RuntimeConfig(**fields), **engine)


def resolve_engine_options(vllm_config, *, is_async: bool) -> AotOptions:
    """The options of the engine `vllm_config` configures (`is_async`: its steps scheduled
    asynchronously), resolved once: a configuration vLLM builds again from a resolved one keeps
    them. The user's flags are those `engine_flags.record_given` recorded."""
    extra = dict(vllm_config.additional_config or {})
    if RESOLVED_KEY in extra:
        return AotOptions.of(vllm_config)
    given = extra.pop(GIVEN_KEY, None)
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    decided = {"draft_model": draft_model_path(vllm_config.speculative_config)}
    if extra.get("stats_file") is None:
        from vllm_aot.plugin.metrics import new_stats_path

        path = new_stats_path()
        decided["stats_file"] = None if path is None else str(path)
    if is_async and parallel.world_size == 1:  # steps on their thread
        _, decided["front_end_cores"] = split_front_end(  # the engine's cores: it forks from here
            available_cores(), is_lowered=front_end_nice() > 0
        )
    vllm = {
        "dtype": model_config.dtype,
        "quantization": model_config.quantization,
        "runner": model_config.runner_type,
        "convert": convert_type(model_config),
        "num_speculative_tokens": num_speculative_tokens(vllm_config),
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "max_model_len": model_config.max_model_len,
    }
    given = given_in_config(vllm_config) if given is None else given
    if "max_model_len" in given:  # as vLLM read it ("1k", or -1: the model's, fitted)
        given = {**given, "max_model_len": model_config.max_model_len}
    options = resolve_options(
        model=model_config.model,
        given=given,
        vllm=vllm,
        extra=extra,
        decided=decided,
    )
    _refuse_uncached(model_config.model, options)
    return options


def convert_type(model_config) -> str | None:
    """vLLM's --convert as the runtime names it: None for a model served as it is."""
    convert = model_config.convert_type
    return None if convert in (None, "none") or model_config.runner_type != "pooling" else convert


def _refuse_uncached(model: str, options) -> None:
    """--require-cached: fail in the front end, before any process starts, naming what is cached
    (an exported directory and the eager backend compile nothing)."""
    if not options.require_cached or options.artifact_dir or options.runtime.backend != "inductor":
        return
    from vllm_aot.cache.program_cache import ProgramCache
    from vllm_aot.models.source import load_arch

    cache = ProgramCache(options.cache_settings())
    arch = load_arch(model)
    missing = cache.missing(arch, options.runtime)
    if missing:
        raise ValueError(cache.miss_message(arch, missing))
