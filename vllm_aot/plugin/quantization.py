"""`--quantization gguf` and `--quantization int8` as vLLM flags.

vLLM validates `--quantization` against its registry of quantization configs before our platform
sees the configuration; this wheel has no GGUF method and no plain weight-only int8 one (its
`int8_per_channel_weight_only` is for MoE experts). `register()`, the `vllm.general_plugins`
entry point vLLM runs in every process, registers one config class per name. vLLM only checks
the name, the activation dtypes and that no config file is needed; our worker loads the weights
itself (`models/weights.py`), so the classes quantise nothing and are never asked for a layer
method.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from vllm_aot.runtime.config import QUANTIZATIONS


class _AotQuantization(QuantizationConfig):
    """A quantization our runtime implements; vLLM sees only its name and dtypes."""

    name = ""

    def get_name(self) -> str:
        return self.name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # nothing to read: the format is in the weights (GGUF) or chosen at load (int8)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _AotQuantization:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> None:
        return None  # vLLM's model layers never run on our platform


def register() -> None:
    """Register every name in `QUANTIZATIONS` once per process (vLLM may call this again)."""
    for name in QUANTIZATIONS:
        if name in QUANTIZATION_METHODS:
            continue
        config = type(f"AotQuantization_{name}", (_AotQuantization,), {"name": name})
        register_quantization_config(name)(config)
