"""Sub-layer capture for the eager backend: a layer program that also reports what is inside it.

A compiled layer program is one opaque graph: only its inputs and outputs (hidden, new K/V) can
be captured. With the eager backend the program is plain Python, and the family's layer maths
hands each sub-layer output to the program's `observe` hook under HF's module name
(`input_layernorm`, `self_attn` after the output projection, `post_attention_layernorm`, `mlp`).
Compiled programs pass a hook that does nothing; this one records to the tap. The reported
tensors are the very ones the layer computes with, so instrumenting can never change what it
measures.
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.kv_cache import blocks_needed
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import Layer, ProgramKind, program_config


class SublayerSink(Protocol):
    """Receives the sub-layer tensors of the layer that runs (a `capture.CaptureTap`)."""

    def sublayer(self, suffix: str, tensor: torch.Tensor) -> None: ...


class InstrumentedLayer(Layer):
    """`programs.Layer` whose sub-layer outputs go to `tap` (same signature and outputs)."""

    def __init__(
        self, arch: ModelArch, config: RuntimeConfig, *, kind: ProgramKind, tap: SublayerSink
    ) -> None:
        super().__init__(arch, config, kind=kind)
        self.tap = tap

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        self.tap.sublayer(name, tensor)


def instrumented_model(model: CompiledModel, tap: SublayerSink, num_tokens: int) -> CompiledModel:
    """An eager copy of `model` (same weights, head programs and config) whose layer programs
    report sub-layer tensors to `tap`, with its own KV pool sized for one `num_tokens` sequence.
    """
    assert model.config.backend == "eager", "sub-layer capture needs the eager backend"
    programs = dict(model.programs)
    for key in programs:
        if key.is_layer:
            config = program_config(key, model.config)  # its layer group's formats
            layer = InstrumentedLayer(model.arch, config, kind=key.kind, tap=tap)
            programs[key] = torch.no_grad()(layer)
    num_blocks = blocks_needed(num_tokens, model.config.block_size) + 1  # + the dummy block
    return CompiledModel(
        model.arch, model.config, model.weights, programs, num_kv_blocks=num_blocks
    )
