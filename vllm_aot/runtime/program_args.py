"""Each program kind's inputs, declared once: one record per kind, its fields the program's
arguments in order (`signature.py` derives the flat call, examples and dynamic shapes).

Shapes name their dimensions: `tokens` (a layer's token bucket: a prefill bucket, or rows x
positions), `rows` (the row bucket), `hidden`, `head_dim`, `block_size`, `kv_heads` (a rank's),
`window`/`windows` (encode programs), `mask_words` (ceil(vocab / 32)), `drafts` (k) and the
layers' `context_blocks`/`context_mask`, whose shape depends on the kind (see the fields).
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import torch
from torch import Tensor

from vllm_aot.runtime.sampler import SamplingTensors
from vllm_aot.runtime.signature import Arg, Dynamic, Tensors
from vllm_aot.runtime.verify import DraftTensors

# A KV pool's blocks: the pool is sized at start-up, so one program serves any size.
BLOCKS = Dynamic("num_blocks", example=2, min=2, max=1 << 24)
_I64 = torch.int64
_POOL = (BLOCKS, "block_size", "kv_heads", "head_dim")


class LayerStep(NamedTuple):
    """What every layer program of a step reads alike, besides the rotary tables."""

    # prefill: [ctx_blocks] the step's cached blocks; decode, verify: [rows, ctx_blocks] each
    # row's block table
    context_blocks: Annotated[Tensor, Arg(("context_blocks",), _I64)]
    # prefill: [tokens, ctx + tokens] each token's visible keys (cached, then the step's);
    # decode, verify: [rows, ctx] each row's cached tokens
    context_mask: Annotated[Tensor, Arg(("context_mask",), torch.bool, fill=True)]
    slots: Annotated[Tensor, Arg(("tokens",), _I64)]  # where each token's K/V go in the pools


class LayerArgs(NamedTuple):
    """A decoder layer program's inputs (prefill, decode, verify): -> (hidden, k_new, v_new).

    The pools are in the KV cache dtype, their scales float32 scalars (`models.layers.PagedKV`;
    inputs, since one program serves every layer); the program writes each token's new K/V at
    its slot of the layer's pools, in place.
    """

    hidden: Annotated[Tensor, Arg(("tokens", "hidden"), "model")]
    cos: Annotated[Tensor, Arg(("tokens", "head_dim"), "model", fill=1)]
    sin: Annotated[Tensor, Arg(("tokens", "head_dim"), "model")]
    k_pool: Annotated[Tensor, Arg(_POOL, "kv")]
    v_pool: Annotated[Tensor, Arg(_POOL, "kv")]
    k_scale: Annotated[Tensor, Arg((), torch.float32, fill=1)]  # a stored key is key / k_scale
    v_scale: Annotated[Tensor, Arg((), torch.float32, fill=1)]
    step: LayerStep
    weights: Annotated[tuple[Tensor, ...], Tensors("weights")]  # `LayerSpec.tensor_names`


class EncodeArgs(NamedTuple):
    """An encoder layer program's inputs: -> (hidden,)."""

    hidden: Annotated[Tensor, Arg(("tokens", "hidden"), "model")]
    # True where a key of the window is visible (`models.layers.packed_attention`)
    mask: Annotated[Tensor, Arg(("windows", "window", "window"), torch.bool, fill=True)]
    weights: Annotated[tuple[Tensor, ...], Tensors("weights")]  # `LayerSpec.tensor_names`


class HeadArgs(NamedTuple):
    """A head program's inputs (greedy, sample): -> the `SamplerOutput` fields, in order."""

    hidden: Annotated[Tensor, Arg(("tokens", "hidden"), "model")]  # tokens: rows x positions
    final_norm: Annotated[Tensor, Arg(("hidden",), "model", fill=1)]
    # the head's stored tensors in its weight format: a rank's vocabulary rows
    lm_head: Annotated[tuple[Tensor, ...], Tensors("lm_head")]
    sampling: SamplingTensors


class VerifyHeadArgs(NamedTuple):
    """A verify head program's inputs: -> the `SamplerOutput` fields of every position, then
    num_accepted (`runtime/verify.py`)."""

    head: HeadArgs
    drafts: DraftTensors
