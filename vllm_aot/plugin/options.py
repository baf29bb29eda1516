"""AotOptions: our settings for one vLLM engine, resolved once from vLLM's config.

Sources, in order: an exported artifact directory given as the model (its manifest fixes every
shape; a --kv-cache-dtype other than its own is refused); vLLM's own flags where the user set
them (--max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size, --dtype,
--kv-cache-dtype, --quantization: each linear's weight format is resolved here, from the model's
.gguf for gguf); `--additional-config` keys named like RuntimeConfig fields (`backend`,
`decode_batch_buckets`, ...) plus the cache options (`cache_dir`, `remote_cache`,
`cache_upload`, `require_cached`) and the engine's `num_threads`; otherwise our defaults. The
platform resolves them in the front-end process and stores the result in
`additional_config["vllm_aot"]`, which vLLM hands to the engine and worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_aot.loading.artifacts import is_artifact_dir, read_manifest
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.runtime.config import RuntimeConfig, kv_cache_dtype_name

RESOLVED_KEY = "vllm_aot"
OPTION_KEYS = (
    "cache_dir",
    "remote_cache",
    "cache_upload",
    "require_cached",
    "stats_file",
    "num_threads",
)
# vLLM's CPU defaults for --max-num-seqs and --max-num-batched-tokens (LLM class, API server):
# a value equal to one of these means the user did not choose one, so ours applies.
_VLLM_DEFAULT_MAX_NUM_SEQS = (128, 256)
_VLLM_DEFAULT_MAX_BATCHED_TOKENS = (2048, 4096)
DEFAULT_MAX_MODEL_LEN = 2048
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


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {name} is not supported by vllm-aot; supported: bfloat16, float32")
    return name


def _default_chunk(runner: str, max_model_len: int) -> int:
    """The largest prefill (encode) bucket when not given. Pooling steps may hold whole prompts
    (vLLM chunks no bidirectional or mean-pooled one), several to a bucket: at least one of
    max_model_len."""
    default = RuntimeConfig.__dataclass_fields__["max_num_batched_tokens"].default
    return min(default, max_model_len) if runner == "generate" else max(default, max_model_len)


def step_token_budget(runtime: RuntimeConfig) -> int:
    """The tokens vLLM may schedule in one step: the largest prefill or encode program's, or an
    encoder's `ENCODE_PROGRAMS_PER_STEP` of them (its runner splits a step into programs)."""
    is_encoder = runtime.runner == "pooling" and runtime.convert is None
    return runtime.max_num_batched_tokens * (ENCODE_PROGRAMS_PER_STEP if is_encoder else 1)


def _check_speculative(asked: int, given: int | None, artifact: str | None = None) -> None:
    """--speculative-config's drafts per step (`asked`) against another source's (`given`: the
    exported directory's, or --additional-config's; None: not given)."""
    if given is None or given == asked:
        return
    source = (
        f"{artifact} is an exported directory compiled for"
        if artifact
        else "--additional-config sets"
    )
    raise ValueError(
        f"{source} num_speculative_tokens {given}; --speculative-config asks {asked} "
        "(give it there)"
    )


def _artifact_runtime(
    model: str,
    kv: str | None,
    num_speculative_tokens: int,
    parallel: tuple[int, bool],
    extra,
) -> RuntimeConfig:
    """An exported directory's configuration; ValueError for a flag contradicting it (`parallel`:
    --tensor-parallel-size and --enable-expert-parallel)."""
    runtime = RuntimeConfig.from_dict(read_manifest(model)["config"])
    if kv is not None and kv_cache_dtype_name(kv) != runtime.kv_cache_dtype:
        raise ValueError(
            f"{model} is an exported directory compiled for kv_cache_dtype "
            f"{runtime.kv_cache_dtype}; --kv-cache-dtype {kv} contradicts it"
        )
    _check_speculative(num_speculative_tokens, runtime.num_speculative_tokens, model)
    tensor_parallel_size, enable_expert_parallel = parallel
    if runtime.tensor_parallel_size != tensor_parallel_size:
        raise ValueError(
            f"{model} is an exported directory compiled for tensor_parallel_size "
            f"{runtime.tensor_parallel_size}; --tensor-parallel-size {tensor_parallel_size} "
            "contradicts it"
        )
    if runtime.enable_expert_parallel != enable_expert_parallel:
        raise ValueError(
            f"{model} is an exported directory compiled with enable_expert_parallel "
            f"{runtime.enable_expert_parallel}; give --enable-expert-parallel exactly when it is"
        )
    if extra:
        raise ValueError(
            f"{model} is an exported directory whose shapes are fixed; "
            f"remove {', '.join(extra)} from --additional-config"
        )
    return runtime


def _parallel_fields(parallel: tuple[int, bool], extra: dict[str, Any]) -> dict[str, Any]:
    """The configuration's fields for --tensor-parallel-size and --enable-expert-parallel (vLLM's
    flags: their values, not --additional-config's, which may only repeat them)."""
    tensor_parallel_size, enable_expert_parallel = parallel
    if extra.get("enable_expert_parallel", enable_expert_parallel) != enable_expert_parallel:
        raise ValueError(
            "--additional-config enable_expert_parallel contradicts --enable-expert-parallel "
            "(give the flag alone)"
        )
    fields: dict[str, Any] = {"enable_expert_parallel": True} if enable_expert_parallel else {}
    if tensor_parallel_size != 1:
        fields["tensor_parallel_size"] = tensor_parallel_size
    return fields


def resolve_options(
    *,
    model: str,
    dtype: Any,
    quantization: str | None = None,
    max_model_len: int,
    is_max_model_len_set: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    is_block_size_set: bool,
    extra: dict[str, Any],
    kv_cache_dtype: str = "auto",
    runner: str = "generate",
    convert: str | None = None,
    num_speculative_tokens: int = 0,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> AotOptions:
    """Decide the compiled shapes for an engine (see the module docstring for precedence).
    `kv_cache_dtype` is vLLM's --kv-cache-dtype: "auto", the model's dtype or an fp8 one;
    `num_speculative_tokens` is --speculative-config's (0: none)."""
    extra = {k: v for k, v in (extra or {}).items() if k != RESOLVED_KEY}
    known = set(RuntimeConfig.__dataclass_fields__) | set(OPTION_KEYS)
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(
            f"unknown vllm-aot option(s) in --additional-config: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    options = {k: extra.pop(k) for k in OPTION_KEYS if k in extra}
    _check_speculative(num_speculative_tokens, extra.get("num_speculative_tokens"))
    kv = None if kv_cache_dtype in ("auto", str(dtype).removeprefix("torch.")) else kv_cache_dtype
    parallel = (tensor_parallel_size, enable_expert_parallel)
    if is_artifact_dir(model):
        runtime = _artifact_runtime(model, kv, num_speculative_tokens, parallel, sorted(extra))
        return AotOptions(runtime=runtime, artifact_dir=Path(model), **options)
    fields: dict[str, Any] = {
        "max_model_len": max_model_len
        if is_max_model_len_set
        else min(max_model_len, DEFAULT_MAX_MODEL_LEN),
        "dtype": _dtype_name(dtype),
        "runner": runner,
        "convert": convert,
    }
    if quantization is not None:
        fields["quantization"] = quantization
    if num_speculative_tokens:
        fields["num_speculative_tokens"] = num_speculative_tokens
    fields |= _parallel_fields(parallel, extra)
    if max_num_seqs not in _VLLM_DEFAULT_MAX_NUM_SEQS:
        fields["max_num_seqs"] = max_num_seqs
    if max_num_batched_tokens not in _VLLM_DEFAULT_MAX_BATCHED_TOKENS:
        fields["max_num_batched_tokens"] = max_num_batched_tokens
    if is_block_size_set:
        fields["block_size"] = block_size
    fields.update(extra)
    if kv is not None:
        given = fields.setdefault("kv_cache_dtype", kv)
        if kv_cache_dtype_name(given) != kv_cache_dtype_name(kv):
            raise ValueError(
                f"--kv-cache-dtype {kv} contradicts --additional-config kv_cache_dtype {given!r}; "
                "give one"
            )
    for name, value in fields.items():
        if name.endswith("_buckets"):
            fields[name] = tuple(value)
    fields.setdefault("max_num_batched_tokens", _default_chunk(runner, fields["max_model_len"]))
    if fields.get("quantization") and not fields.get("weight_formats"):
        dtype = RuntimeConfig(dtype=fields["dtype"]).torch_dtype
        fields["weight_formats"] = resolve_weight_formats(model, fields["quantization"], dtype)
    return AotOptions(runtime=RuntimeConfig(**fields), **options)
