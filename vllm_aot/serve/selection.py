"""Which cached configuration `vllm-aot serve` should run, from the compile cache's registry.

Every shape the user gave (serve flags or the same vLLM flags) must match exactly; what they left
open is decided by `select_configuration` (largest TP, then batch, then length that fits the cores
of one replica). The dtype, when not given, is the one vLLM would pick on a CPU (bfloat16), so the
registry never silently switches a user to float32.
"""

from __future__ import annotations

from pathlib import Path

from vllm_aot.plugin.engine_flags import parse_vllm_flags
from vllm_aot.plugin.options import pinned_fields
from vllm_aot.runtime.options import SELECTABLE
from vllm_aot.serve.settings import RegistryPick, ShapeFlags

DEFAULT_DTYPE = "bfloat16"  # vLLM's "auto" on a CPU for float32 and bfloat16 checkpoints
# What a command line that leaves these open runs: the platform's choice, pinned for selection.
_UNGIVEN = {
    "quantization": "none",
    "kv_cache_dtype": "auto",
    "num_speculative_tokens": 0,
    "enable_expert_parallel": False,
}


def requested_shapes(flags: ShapeFlags, passthrough: tuple[str, ...]) -> dict[str, object]:
    """The shapes the command line pins (None where it leaves them open), as the platform will
    resolve them: vLLM's flags read by vLLM's parser, then the platform's `pinned_fields`."""
    given = {**parse_vllm_flags(passthrough).given, **flags.given()}
    given.setdefault("dtype", DEFAULT_DTYPE)
    pinned = pinned_fields(given, {}, dtype=given["dtype"])
    requested = {name: pinned.get(name) for name in SELECTABLE}
    requested |= {k: v for k, v in _UNGIVEN.items() if requested[k] is None}
    requested["tensor_parallel_size"] = flags.tensor_parallel_size
    return requested


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
    from vllm_aot.models.source import load_arch
    from vllm_aot.runtime.config import RuntimeConfig

    if backend != "inductor":
        return None, "eager backend: no compiled configuration to choose"
    extra = parse_vllm_flags(passthrough).additional_config
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
