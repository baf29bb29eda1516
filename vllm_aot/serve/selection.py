"""Which cached configuration `vllm-aot serve` should run, from the compile cache's registry.

Every shape the user gave (serve flags or the same vLLM flags) must match exactly; what they left
open is decided by `select_configuration` (largest TP, then batch, then length that fits the cores
of one replica). The dtype, when not given, is the one vLLM would pick on a CPU (bfloat16), so the
registry never silently switches a user to float32.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_aot.runtime.config import KV_CACHE_ALIASES
from vllm_aot.serve.settings import RegistryPick, ShapeFlags, flag_value, speculative_tokens

DEFAULT_DTYPE = "bfloat16"  # vLLM's "auto" on a CPU for float32 and bfloat16 checkpoints
_INT_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "block_size": "--block-size",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}


def requested_shapes(flags: ShapeFlags, passthrough: tuple[str, ...]) -> dict[str, object]:
    """The shapes the command line pins (None where it leaves them open)."""
    pinned: dict[str, object] = {}
    for key, vllm_flag in _INT_FLAGS.items():
        text = flag_value(passthrough, vllm_flag)
        pinned[key] = int(text) if text is not None else None
    if flags.batch_size is not None:
        pinned["max_num_seqs"] = flags.batch_size
    if flags.max_model_len is not None:
        pinned["max_model_len"] = flags.max_model_len
    dtype = flags.dtype or flag_value(passthrough, "--dtype")
    pinned["dtype"] = DEFAULT_DTYPE if dtype in (None, "auto") else dtype
    pinned["quantization"] = flags.quantization or flag_value(passthrough, "--quantization")
    pinned["quantization"] = pinned["quantization"] or "none"
    kv = flags.kv_cache_dtype or flag_value(passthrough, "--kv-cache-dtype") or "auto"
    pinned["kv_cache_dtype"] = KV_CACHE_ALIASES.get(kv, kv)
    pinned["tensor_parallel_size"] = flags.tensor_parallel_size
    pinned["num_speculative_tokens"] = speculative_tokens(passthrough)
    return pinned


def pick_from_registry(
    model_dir: Path,
    flags: ShapeFlags,
    passthrough: tuple[str, ...],
    *,
    backend: str,
    cores_per_replica: int,
    cache_settings,
) -> tuple[RegistryPick | None, str]:
    """The registry's configuration for this model and command line, and why (or why none)."""
    from vllm_aot.cache.keys import arch_digest
    from vllm_aot.cache.program_cache import ProgramCache
    from vllm_aot.cache.registry import select_configuration
    from vllm_aot.models.pooling import declared_max_len
    from vllm_aot.models.registry import load_arch
    from vllm_aot.runtime.config import RuntimeConfig

    if backend != "inductor":
        return None, "eager backend: no compiled configuration to choose"
    extra = json.loads(flag_value(passthrough, "--additional-config") or "{}")
    if set(extra) & set(RuntimeConfig.__dataclass_fields__):
        return None, "--additional-config sets shapes itself: the registry is not consulted"
    arch = load_arch(model_dir)
    entries = ProgramCache(cache_settings).registry.entries(arch_digest(arch))
    # vLLM refuses a length beyond the model's own limit (a sentence-transformers directory's
    # max_seq_length where it declares one), so configurations compiled longer are not offered.
    limit = declared_max_len(model_dir) or arch.max_position_embeddings
    entries = [e for e in entries if e.runtime["max_model_len"] <= limit]
    requested = requested_shapes(flags, passthrough)
    entry, why = select_configuration(entries, requested, num_cores=cores_per_replica)
    if entry is None:
        return None, f"{why}; defaults apply (compiled on first start unless --require-cached)"
    return RegistryPick(entry.runtime, why), why
