"""HF architecture name -> the family that implements it; one line per family file.

Each family (`models/family.py` says what one states) lives in its own file; registering it is
adding its `FAMILY` to `FAMILIES`. Everything else finds a model's family here: the HF
`architectures` name when reading a config (`source.load_arch`), `ModelArch.family` afterwards.
"""

from __future__ import annotations

from typing import Any

from vllm_aot.models import bert, llama, mixtral, qwen2, qwen3, qwen3_moe
from vllm_aot.models.config import ModelArch
from vllm_aot.models.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    bert.FAMILY,
)


def _by_architecture() -> dict[str, Family]:
    return {name: family for family in FAMILIES for name in family.architectures}


def supported_architectures() -> list[str]:
    return sorted(_by_architecture())


def encoder_architectures() -> list[str]:
    """The HF names of encoders (served by runner "pooling" alone)."""
    return sorted(n for f in FAMILIES if f.is_encoder for n in f.architectures)


def family_of(arch: ModelArch) -> Family:
    """The registered family of an architecture read by `arch_from_hf_config`."""
    family = next((f for f in FAMILIES if f.name == arch.family), None)
    assert family is not None, f"family {arch.family!r} is not registered"
    return family


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """Build a `ModelArch`; raises ValueError naming the supported architectures, or the
    family's refusal of a feature it does not implement."""
    names = config.get("architectures") or []
    families = _by_architecture()
    name = next((n for n in names if n in families), None)
    if name is None:
        raise ValueError(
            f"architecture {names or config.get('model_type')!r} is not supported by vllm-aot; "
            f"supported: {', '.join(supported_architectures())}"
        )
    return families[name].parse_config(name, config)
