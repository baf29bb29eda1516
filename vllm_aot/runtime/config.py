"""RuntimeConfig: the static shapes a compiled model is built for. Frozen, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vllm_aot.models.config import ModelArch
from vllm_aot.models.formats import dense_format, weight_format
from vllm_aot.models.linear import Rank, whole_name
from vllm_aot.runtime.buckets import powers_of_two, validate_buckets
from vllm_aot.runtime.layer_groups import layers_text, normal_groups, overrides_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("inductor", "eager")
# Weight quantization as vLLM names it: None (the dense format of `dtype`), "int8" (every linear,
# the embedding and the head quantised at load), "gguf" (the formats a .gguf file stores).
QUANTIZATIONS = ("int8", "gguf")
# KV cache element types as vLLM names them ("fp8" is "fp8_e4m3"); "auto" is `dtype`.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
# vLLM's runners: "generate" (decoders: prefill, decode and head programs) or "pooling"
# (encoders: one encode program per token bucket, no KV cache, no head; a decoder converted by
# `convert` "embed": its prefill programs alone, pooled over its final norm's output).
RUNNERS = ("generate", "pooling")
CONVERTS = ("embed",)
ALL_LINEARS = "*"  # `weight_formats`' name for every linear not named
MAX_SPECULATIVE_TOKENS = 8  # drafts per row a verify program takes at most
DEFAULT_MAX_VERIFY_BATCH = 8  # verify programs by default up to this batch bucket
MIN_ENCODE_WINDOW = 64  # narrowest attention window of encode programs (`encode_windows`)
KEYS_PROGRAMS = "keys_programs"  # a field's mark: whether compiled programs read it (`keyed`)


def keyed(default: Any) -> Any:
    """A field compiled programs read (their graphs change with it): part of every program's
    cache key (`cache/keys.py`)."""
    return field(default=default, metadata={KEYS_PROGRAMS: True})


def unkeyed(default: Any) -> Any:
    """A field programs do not read: it picks which programs exist (buckets, limits, the
    runner), builds them (the backend) or sizes what they are given (the pool)."""
    return field(default=default, metadata={KEYS_PROGRAMS: False})


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything that fixes the compiled programs' shapes, plus the backend that builds them.

    Buckets left empty get defaults: decode batches 1, 2, 4, ... max_num_seqs; decode contexts
    256, 1024, ... max_model_len tokens; prefill chunks 32, 128, ... max_num_batched_tokens tokens
    (factors of four: each program costs ~10 s of compile, padding costs less); prefill contexts
    0, 256, 512, 1024, ... max_model_len tokens (prefill attention reads its whole context bucket,
    so these go by twos).
    """

    max_num_seqs: int = unkeyed(32)
    max_model_len: int = unkeyed(2048)
    block_size: int = keyed(16)
    max_num_batched_tokens: int = unkeyed(512)
    dtype: str = keyed("bfloat16")
    backend: str = unkeyed("inductor")
    decode_batch_buckets: tuple[int, ...] = unkeyed(())
    # tokens of KV read per row, multiples of block
    decode_context_buckets: tuple[int, ...] = unkeyed(())
    prefill_token_buckets: tuple[int, ...] = unkeyed(())
    prefill_context_buckets: tuple[int, ...] = unkeyed(())  # cached tokens read per prefill step
    num_logprobs: int = keyed(20)  # top-n logprobs every head program returns
    num_sampling_candidates: int = keyed(256)  # top-k/top-p decide among this many tokens
    num_kv_blocks: int | None = unkeyed(None)  # default: every row at max_model_len, plus the dummy
    quantization: str | None = unkeyed(None)  # one of QUANTIZATIONS; None: dense weights of `dtype`
    # (linear name, a fused linear's part as "qkv_proj.2", or "*"; weight format): every
    # linear's format, resolved at load from `quantization` and the checkpoint
    # (`models/checkpoints.py`); () for dense weights, and for "gguf" until start-up reads it.
    weight_formats: tuple[tuple[str, str], ...] = keyed(())
    # Layers whose linears differ from `weight_formats` (`runtime/layer_groups.py`): groups 1, 2,
    # ... as (layers, (linear name, weight format) overrides); () for one group (every layer in
    # `weight_formats`). Each group has its own layer programs, compiled from its configuration
    # (`for_group`), whose `weight_formats` their cache keys hold: this field itself is in none.
    layer_groups: tuple[tuple[tuple[int, ...], tuple[tuple[str, str], ...]], ...] = unkeyed(())
    kv_cache_dtype: str = keyed("auto")  # a KV_CACHE_DTYPES name (or alias)
    runner: str = unkeyed("generate")  # one of RUNNERS
    # one of CONVERTS (vLLM's --convert), a decoder under "pooling"
    convert: str | None = unkeyed(None)
    # Speculative decoding: drafts verified per row per step (0: none, no verify programs), and
    # the batches verify programs exist for (default: the decode batches up to 8; a larger
    # batch decodes without drafts).
    num_speculative_tokens: int = unkeyed(0)
    verify_batch_buckets: tuple[int, ...] = unkeyed(())
    # Ranks the model is split over (heads, KV heads, intermediate features, vocabulary): every
    # rank runs the same programs on its own weights, collectives between (kernels/collectives).
    tensor_parallel_size: int = keyed(1)
    # vLLM's --enable-expert-parallel: an MoE model's experts split whole over those ranks (each
    # its range of experts) instead of each expert by intermediate features; attention stays
    # tensor-parallel.
    enable_expert_parallel: bool = keyed(False)

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner {self.runner!r} is not supported; supported: {list(RUNNERS)}")
        if self.convert is not None and (self.convert not in CONVERTS or self.runner != "pooling"):
            raise ValueError(
                f"convert {self.convert!r} with runner {self.runner!r} is not supported; "
                f"supported: {', '.join(CONVERTS)} with runner 'pooling'"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; supported: {list(DTYPES)}")
        self._check_formats()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown; supported: {list(BACKENDS)}")
        names = ("max_num_seqs", "max_model_len", "block_size", "max_num_batched_tokens")
        for name in (*names, "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len % self.block_size:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        defaults = {
            "decode_batch_buckets": (powers_of_two(1, self.max_num_seqs), self.max_num_seqs),
            "prefill_token_buckets": (
                # An encoder's programs are small and quick to compile: finer buckets, less padding.
                powers_of_two(min(32, self.max_num_batched_tokens), self.max_num_batched_tokens)
                if self.is_encoder_runner
                else _by_fours(32, self.max_num_batched_tokens),
                self.max_num_batched_tokens,
            ),
            "decode_context_buckets": (
                _by_fours(256, self.max_model_len),
                self.max_model_len,
            ),
            # A fresh prompt reads no cache: its own bucket (0) spares it attending over padded
            # keys at all (a 128-token prompt against 128 keys, not 256 + 128). Later chunks of a
            # long prompt read what earlier chunks wrote, and prefill attention pays for its
            # whole bucket: by twos, so past 128 cached tokens a chunk reads less than twice its
            # context, and with 512-token chunks the contexts 512 and 1024 fit exactly (1536
            # reads 2048). A 1024-token prompt's second chunk attends over 512 + 512 keys, not
            # 1024 + 512 (docs/benchmarks.md#prefill-context-buckets).
            "prefill_context_buckets": (
                (0, *powers_of_two(min(256, self.max_model_len), self.max_model_len)),
                self.max_model_len,
            ),
        }
        for name, (default, maximum) in defaults.items():
            minimum = 0 if name == "prefill_context_buckets" else 1
            values = validate_buckets(name, getattr(self, name) or default, maximum, minimum)
            if name.endswith("context_buckets") and any(v % self.block_size for v in values):
                raise ValueError(f"{name} must be multiples of block_size ({self.block_size})")
            # Frozen: normalise the field once, here, before anyone reads it.
            object.__setattr__(self, name, values)
        self._check_speculative()
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.max_blocks_per_seq + 1:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) cannot hold one sequence of max_model_len "
                f"({self.max_blocks_per_seq} blocks of {self.block_size}) plus the dummy block"
            )

    def _check_speculative(self) -> None:
        k = self.num_speculative_tokens
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if not k:
            if self.verify_batch_buckets:
                raise ValueError("verify_batch_buckets given without num_speculative_tokens")
            return
        default = tuple(b for b in self.decode_batch_buckets if b <= DEFAULT_MAX_VERIFY_BATCH)
        buckets = tuple(sorted(set(self.verify_batch_buckets))) or default
        if not set(buckets) <= set(self.decode_batch_buckets):
            raise ValueError(
                f"verify_batch_buckets {buckets} must be decode batch buckets "
                f"({self.decode_batch_buckets})"
            )
        object.__setattr__(self, "verify_batch_buckets", buckets)

    def _check_formats(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; supported: "
                f"{', '.join(QUANTIZATIONS)} (or none)"
            )
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))
        formats = tuple(tuple(pair) for pair in self.weight_formats)
        if self.quantization == "int8" and not formats:
            formats = ((ALL_LINEARS, "int8"),)
        if self.quantization is None and formats:
            raise ValueError(f"weight_formats {formats} given without a quantization")
        for _, name in formats:
            weight_format(name)  # ValueError naming the supported formats
        object.__setattr__(self, "weight_formats", tuple(sorted(formats)))
        base = dict(formats)
        default = base.get(ALL_LINEARS, dense_format(self.torch_dtype).name)
        groups = normal_groups(self.layer_groups, lambda name: base.get(name, default))
        if groups and (self.quantization is None or self.is_encoder_runner):
            raise ValueError("layer_groups are for a decoder's quantised weights")
        for _, overrides in groups:
            for _, name in overrides:
                weight_format(name)
        object.__setattr__(self, "layer_groups", groups)

    @property
    def has_resolved_formats(self) -> bool:
        """False for quantization "gguf" until start-up reads the file's weight formats
        (`models.checkpoints.resolve_weight_formats`); nothing may read the formats before."""
        return self.quantization != "gguf" or bool(self.weight_formats)

    def _formats(self) -> dict[str, str]:
        assert self.has_resolved_formats, "the GGUF's weight formats are read at start-up first"
        return dict(self.weight_formats)

    def linear_format(self, name: str) -> str:
        """The weight format of linear `name` (`linear.EMBEDDING`, `LM_HEAD`, or a layer's in
        layer group 0; `layer_formats` gives another layer's), or of a fused linear's part
        (`linear.part_name`, e.g. "qkv_proj.2"; its linear's unless named)."""
        formats = self._formats()
        fmt = formats.get(name) or formats.get(whole_name(name)) or formats.get(ALL_LINEARS)
        return fmt or dense_format(self.torch_dtype).name

    @property
    def num_layer_groups(self) -> int:
        return 1 + len(self.layer_groups)

    def layer_group(self, layer: int) -> int:
        """The group of layer index `layer` (0: every layer no group names)."""
        return next((g for g, (ls, _) in enumerate(self.layer_groups, 1) if layer in ls), 0)

    def for_group(self, group: int) -> RuntimeConfig:
        """One layer group's configuration: its formats as `weight_formats`, no groups (what
        its layer programs are compiled from and keyed by; group 0's serves the heads)."""
        if not self.layer_groups:
            return self
        overrides = dict(self.layer_groups[group - 1][1]) if group else {}
        formats = tuple({**self._formats(), **overrides}.items())
        return dataclasses.replace(self, weight_formats=formats, layer_groups=())

    def layer_formats(self, layer: int):
        """Layer `layer`'s linear name -> weight format (`linear_format` of its group)."""
        return self.for_group(self.layer_group(layer)).linear_format

    def formats_used(self) -> frozenset[str]:
        """Every weight format the programs' linears use (what their kernels are chosen for)."""
        formats = self._formats()
        dense = () if ALL_LINEARS in formats else (dense_format(self.torch_dtype).name,)
        groups = [fmt for _, overrides in self.layer_groups for _, fmt in overrides]
        return frozenset([*formats.values(), *dense, *groups])

    def groups_summary(self, num_layers: int) -> str:
        """The start-up log's line: "2 layer groups: layers 0-1,3 q4_0; layers 2,4 down_proj,
        qkv_proj q8_0"."""
        named = {i for layers, _ in self.layer_groups for i in layers}
        rest = [i for i in range(num_layers) if i not in named]
        parts = [f"layers {layers_text(rest)} {self.formats_summary(groups=False)}"]
        parts += [f"layers {layers_text(ls)} {overrides_text(o)}" for ls, o in self.layer_groups]
        return f"{self.num_layer_groups} layer groups: {'; '.join(parts)}"

    def formats_summary(self, *, groups: bool = True) -> str:
        """What `cache lookup`, the registry and logs show: "q4_1 (embed_tokens, lm_head: q8_0)",
        then each further layer group's layers and overrides ("; layers 2,4: down_proj q8_0")."""
        formats = self._formats()
        if not formats:
            return dense_format(self.torch_dtype).name
        base = formats.pop(ALL_LINEARS, dense_format(self.torch_dtype).name)
        by_format: dict[str, list[str]] = {}
        for linear, fmt in formats.items():
            by_format.setdefault(fmt, []).append(linear)
        rest = "; ".join(f"{', '.join(names)}: {fmt}" for fmt, names in by_format.items())
        text = f"{base} ({rest})" if rest else base
        shown = self.layer_groups if groups else ()
        return text + "".join(f"; layers {layers_text(ls)}: {overrides_text(o)}" for ls, o in shown)

    @property
    def is_encoder_runner(self) -> bool:
        """Runner "pooling" of a model as it is (an encoder: encode programs, no KV cache)."""
        return self.runner == "pooling" and self.convert is None

    def encode_windows(self, num_tokens: int) -> tuple[int, ...]:
        """The attention windows of the encode programs of `num_tokens`: sequences are packed
        into windows, none across an edge, and attend within their window, so attention costs
        tokens x window, not tokens^2. Powers of two from 64 up to the smallest holding
        max_model_len, those dividing the bucket (a step takes the smallest that holds its
        longest sequence: sentences of a few dozen tokens attend over 64, not max_model_len),
        and the whole bucket where it is narrower than the widest."""
        widest = 1 << (self.max_model_len - 1).bit_length()
        powers = powers_of_two(min(MIN_ENCODE_WINDOW, widest), widest)
        windows = [w for w in powers if num_tokens % w == 0]
        if num_tokens <= widest and num_tokens not in windows:
            windows.append(num_tokens)
        return tuple(windows)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element type."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.max_model_len // self.block_size

    def rank_arch(self, arch: ModelArch) -> ModelArch:
        """One rank's share of `arch` (`ModelArch.for_rank`); ValueError naming what does not
        split."""
        return arch.for_rank(self.tensor_parallel_size, expert_parallel=self.enable_expert_parallel)

    def rank(self, index: int) -> Rank:
        """Rank `index` of the configuration's ranks, as weights are sliced for it."""
        return Rank(
            index, self.tensor_parallel_size, is_expert_parallel=self.enable_expert_parallel
        )

    @property
    def total_kv_blocks(self) -> int:
        return self.num_kv_blocks or self.max_num_seqs * self.max_blocks_per_seq + 1

    @property
    def head_row_buckets(self) -> tuple[int, ...]:
        """Rows a head program samples: decode batches, and sequences ending in a prefill step."""
        return self.decode_batch_buckets

    def for_draft(self) -> RuntimeConfig:
        """A draft model's configuration (speculative decoding's `draft_model`): the target's
        shapes and pool, dense weights of its dtype, no verify programs of its own."""
        return dataclasses.replace(
            self,
            quantization=None,
            weight_formats=(),
            layer_groups=(),
            num_speculative_tokens=0,
            verify_batch_buckets=(),
        )

    @staticmethod
    def keyed_fields() -> tuple[str, ...]:
        """The fields marked `keyed`: what every compiled program's cache key holds."""
        return tuple(f.name for f in dataclasses.fields(RuntimeConfig) if f.metadata[KEYS_PROGRAMS])

    def shape_fields(self) -> dict[str, Any]:
        """The fields that change compiled programs (not the backend's cache or the pool size)."""
        fields = asdict(self)
        for name in ("backend", "num_kv_blocks"):
            fields.pop(name)
        return fields

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> RuntimeConfig:
        known = {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}
        for name, value in known.items():
            if name.endswith("_buckets"):
                known[name] = tuple(value)
        known["weight_formats"] = tuple(tuple(p) for p in known.get("weight_formats", ()))
        return cls(**known)


def kv_cache_dtype_name(name: str) -> str:
    """A KV cache dtype as `RuntimeConfig.kv_cache_dtype` holds it (aliases resolved); ValueError
    naming the supported ones."""
    kv = KV_CACHE_ALIASES.get(name, name)
    if kv not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported; supported: "
            f"{', '.join([*KV_CACHE_DTYPES, *KV_CACHE_ALIASES])}"
        )
    return kv


def _by_fours(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(sorted(set(powers_of_two(min(lo, hi), hi)[::2]) | {hi}))
