"""Sub-layer capture for the eager backend: a layer program that also reports what is inside it.

A compiled layer program is one opaque graph: only its inputs and outputs (hidden, new K/V) can
be captured. With the eager backend the program is plain Python, so an instrumented copy can
report the outputs HF names `input_layernorm`, `self_attn` (after the output projection),
`post_attention_layernorm` and `mlp`. The layer's real outputs still come from the unchanged
program maths (`programs.Layer.forward`); the sub-layer tensors are recomputed beside it from the
same functions of `models/layers.py` (the MLP's three lines restated, since `finish_layer` fuses
it with the residuals), so instrumenting can never change what it measures.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from vllm_aot.models.config import ModelArch
from vllm_aot.models.layers import project_qkv, rms_norm
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.kv_cache import blocks_needed
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import Layer, ProgramKind, unflatten_weights


class SublayerSink(Protocol):
    """Receives the sub-layer tensors of the layer that runs (a `capture.CaptureTap`)."""

    def sublayer(self, suffix: str, tensor: torch.Tensor) -> None: ...


class InstrumentedLayer(Layer):
    """`programs.Layer` plus sub-layer reports to `tap` (same signature and outputs)."""

    def __init__(
        self, arch: ModelArch, config: RuntimeConfig, *, is_prefill: bool, tap: SublayerSink
    ) -> None:
        super().__init__(arch, config, is_prefill=is_prefill)
        self.tap = tap

    def forward(self, hidden, cos, sin, k_pool, v_pool, ctx_a, ctx_b, *weights):
        out, k, v = super().forward(hidden, cos, sin, k_pool, v_pool, ctx_a, ctx_b, *weights)
        w = unflatten_weights(self.layout, weights)
        eps = self.dims.rms_norm_eps
        self.tap.sublayer("input_layernorm", rms_norm(hidden, w.input_norm, eps))
        q, k_side, v_side = project_qkv(hidden, w, self.dims, cos, sin, self.linear)
        attn = self.linear(self.attention(q, k_side, v_side, k_pool, v_pool, ctx_a, ctx_b), w.wo)
        self.tap.sublayer("self_attn", attn)
        h = rms_norm(hidden + attn, w.post_norm, eps)
        self.tap.sublayer("post_attention_layernorm", h)
        gate, up = self.linear(h, w.w13).chunk(2, dim=-1)
        self.tap.sublayer("mlp", self.linear(F.silu(gate) * up, w.w2))
        return out, k, v


def instrumented_model(model: CompiledModel, tap: SublayerSink, num_tokens: int) -> CompiledModel:
    """An eager copy of `model` (same weights, head programs and config) whose layer programs
    report sub-layer tensors to `tap`, with its own KV pool sized for one `num_tokens` sequence.
    """
    assert model.config.backend == "eager", "sub-layer capture needs the eager backend"
    programs = dict(model.programs)
    for key in programs:
        if key.is_layer:
            is_prefill = key.kind is ProgramKind.PREFILL
            layer = InstrumentedLayer(model.arch, model.config, is_prefill=is_prefill, tap=tap)
            programs[key] = torch.no_grad()(layer)
    num_blocks = blocks_needed(num_tokens, model.config.block_size) + 1  # + the dummy block
    return CompiledModel(
        model.arch, model.config, model.weights, programs, num_kv_blocks=num_blocks
    )
