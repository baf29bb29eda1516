"""HF transformers on the weights our configuration holds: what a load-time quantization does to
a checkpoint, applied to the HF model the accuracy tools compare against.

`vllm-aot validate` on an int8 configuration compares ours with HF computing on the very
weights ours holds (each linear's float weight quantised by its format and dequantised), so an
error of our own shows up as such and the quantization's own error is the expected deviation
(three-way: HF fp32 on the original weights is the baseline). A GGUF's weights are already the
quantised values (the prepared directory holds them dequantised), so nothing is simulated there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm_aot.models.config import ModelArch
from vllm_aot.models.formats import weight_format
from vllm_aot.models.linear import EMBEDDING, LM_HEAD
from vllm_aot.models.registry import family_of
from vllm_aot.runtime.config import RuntimeConfig

Simulation = Callable[[nn.Module], None]


def simulation_for(arch: ModelArch, config: RuntimeConfig) -> Simulation | None:
    """What turns an HF model's weights into ours, or None when they are the same."""
    if config.quantization != "int8":
        return None
    family = family_of(arch)
    spec = family.layer_spec(arch, "fp32").with_formats(config.linear_format)
    by_source = {source: linear.format for linear in spec.linears() for source in linear.sources}
    by_source[family.embedding] = config.linear_format(EMBEDDING)
    by_source[family.lm_head] = config.linear_format(LM_HEAD)
    layer_prefix = family.layer_prefix.split("{")[0]  # "model.layers."

    def format_of(module_name: str) -> str | None:
        if module_name.startswith(layer_prefix):
            module_name = module_name.split(".", 3)[-1]  # drop "model.layers.{i}."
        return by_source.get(module_name)

    def simulate(model: nn.Module) -> None:
        with torch.no_grad():
            for name, module in model.named_modules():
                fmt = format_of(name)
                if fmt is None or not isinstance(module, nn.Linear | nn.Embedding):
                    continue
                stored = weight_format(fmt).prepare(module.weight.float())
                module.weight.copy_(weight_format(fmt).dequantize(*stored))

    return simulate
