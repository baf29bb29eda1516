"""Our options, one table: each one's name (a `RuntimeConfig` field or an engine option, and its
`--additional-config` key), the vLLM flag that sets it, the `vllm-aot` command flag, its help,
its default and whether it keys compiled programs.

A default is `RuntimeConfig`'s, declared there once; an engine option (`AotOptions` in the
plugin) has none here: not given, the engine decides. Whether an option keys every program is
its field's mark in `RuntimeConfig` (`keyed`); whether it picks programs (which exist, or their
keys) is whether it is one of `RuntimeConfig.shape_fields()`. The plugin resolves the options from
vLLM's configuration (`plugin/options.py`), the `vllm-aot` commands build their flags from this
table (`cli/args.py`), `vllm-aot serve` reads vLLM's flags through vLLM's own parser, and the
compile cache's registry selects on the options a command line can pin (`SELECTABLE`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_aot.runtime.config import (
    BACKENDS,
    DTYPES,
    KEYS_PROGRAMS,
    KV_CACHE_ALIASES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    RuntimeConfig,
)

_RUNTIME_FIELDS = {f.name: f for f in dataclasses.fields(RuntimeConfig)}
_SHAPE_FIELDS = frozenset(RuntimeConfig().shape_fields())
# The key of --speculative-config that sets `num_speculative_tokens` (vLLM's flag is a JSON dict).
SPECULATIVE_FLAG = "--speculative-config"


@dataclass(frozen=True)
class Option:
    name: str  # RuntimeConfig field or engine option; its --additional-config key
    help: str
    vllm_flag: str | None = None  # the vLLM flag that sets it (None: --additional-config only)
    cli_flag: str | None = None  # the `vllm-aot export`/`demo` flag (None: none)
    serve: bool = False  # `vllm-aot serve` has `cli_flag` too (passed on as `vllm_flag`)
    choices: tuple[str, ...] | None = None

    @property
    def is_runtime(self) -> bool:
        """A RuntimeConfig field (else an engine option: cache, threads, stats)."""
        return self.name in _RUNTIME_FIELDS

    @property
    def default(self) -> Any:
        """RuntimeConfig's default (empty buckets: derived from the limits); None for an
        engine option."""
        if not self.is_runtime:
            return None
        field = _RUNTIME_FIELDS[self.name]
        return field.default if field.default is not dataclasses.MISSING else None

    @property
    def keys_programs(self) -> bool:
        """Whether its value is part of every compiled program's cache key (its field is
        marked `keyed` in `RuntimeConfig`)."""
        return self.is_runtime and _RUNTIME_FIELDS[self.name].metadata[KEYS_PROGRAMS]

    @property
    def picks_programs(self) -> bool:
        """Whether it changes which programs a configuration compiles, or their keys (one of
        `RuntimeConfig.shape_fields()`): a compiled configuration is selected by it."""
        return self.name in _SHAPE_FIELDS

    @property
    def engine_arg(self) -> str | None:
        """The attribute of vLLM's EngineArgs that `vllm_flag` sets (None for none, and for
        --speculative-config, whose value is a dict holding this option)."""
        if self.vllm_flag is None or self.vllm_flag == SPECULATIVE_FLAG:
            return None
        return self.vllm_flag.removeprefix("--").replace("-", "_")

    @property
    def dest(self) -> str | None:
        """The argparse attribute of `cli_flag`."""
        return self.cli_flag.removeprefix("--").replace("-", "_") if self.cli_flag else None


_KV_CHOICES = (*KV_CACHE_DTYPES, *KV_CACHE_ALIASES)

OPTIONS: tuple[Option, ...] = (
    Option("max_num_seqs", "max sequences per decode step", "--max-num-seqs", "--batch-size",
           serve=True),
    Option("max_model_len", "longest sequence, prompt and output (tokens)", "--max-model-len",
           "--max-model-len", serve=True),
    Option("block_size", "tokens per KV block", "--block-size", "--block-size"),
    Option("max_num_batched_tokens", "largest prefill chunk (tokens)", "--max-num-batched-tokens",
           "--max-num-batched-tokens"),
    Option("dtype", "activations and dense weights", "--dtype", "--dtype", serve=True,
           choices=tuple(DTYPES)),
    Option("quantization", "gguf: a .gguf file's blocks as they are; int8: every linear "
           "quantised at load (default: dense weights)", "--quantization", "--quantization",
           serve=True, choices=QUANTIZATIONS),
    Option("kv_cache_dtype", "KV cache elements (auto: the dtype; fp8 is fp8_e4m3)",
           "--kv-cache-dtype", "--kv-cache-dtype", serve=True, choices=_KV_CHOICES),
    Option("tensor_parallel_size", "ranks the model is split over", "--tensor-parallel-size",
           "--tensor-parallel-size", serve=True),
    Option("enable_expert_parallel", "an MoE model's experts split whole over the ranks",
           "--enable-expert-parallel", "--enable-expert-parallel"),
    Option("runner", "generate (decoders) or pooling (encoders, converted decoders)", "--runner"),
    Option("convert", "embed: a decoder served as an embedding model", "--convert"),
    Option("num_speculative_tokens", "drafts verified per row per step", SPECULATIVE_FLAG),
    Option("backend", "what compiles the programs", cli_flag="--backend", serve=True,
           choices=BACKENDS),
    Option("decode_batch_buckets", "decode batches compiled", cli_flag="--decode-batch-buckets"),
    Option("decode_context_buckets", "decode contexts compiled (tokens)",
           cli_flag="--decode-context-buckets"),
    Option("prefill_token_buckets", "prefill chunks compiled (tokens)",
           cli_flag="--prefill-token-buckets"),
    Option("prefill_context_buckets", "cached tokens a prefill chunk reads (tokens)",
           cli_flag="--prefill-context-buckets"),
    Option("num_kv_blocks", "KV pool blocks (default: every row at max_model_len)",
           cli_flag="--num-kv-blocks"),
    Option("num_logprobs", "top-n logprobs every head program returns"),
    Option("num_sampling_candidates", "tokens top-k/top-p decide among"),
    Option("weight_formats", "each linear's weight format (resolved from quantization)"),
    Option("layer_groups", "layers whose linears' formats differ (resolved from a GGUF)"),
    Option("verify_batch_buckets", "decode batches that verify drafts"),
    Option("cache_dir", "local compile cache (default: VLLM_AOT_COMPILE_CACHE or ~)"),
    Option("remote_cache", "shared store of compiled programs, file:// or s3:// "
           "(default: VLLM_AOT_REMOTE_CACHE)"),
    Option("cache_upload", "upload what this engine compiles (default: VLLM_AOT_CACHE_UPLOAD)"),
    Option("require_cached", "a missing program is an error instead of a compile"),
    Option("stats_file", "where the worker reports start-up counters"),
    Option("num_threads", "the engine's torch threads (default: one per core of its affinity)"),
)  # fmt: skip
BY_NAME = {option.name: option for option in OPTIONS}
assert set(_RUNTIME_FIELDS) <= set(BY_NAME), "every RuntimeConfig field is an option"
ENGINE_OPTIONS = tuple(o.name for o in OPTIONS if not o.is_runtime)
VLLM_OPTIONS = tuple(o for o in OPTIONS if o.vllm_flag is not None)
# What a command line can pin when `vllm-aot serve` picks a compiled configuration.
SELECTABLE = tuple(o.name for o in VLLM_OPTIONS if o.picks_programs)
