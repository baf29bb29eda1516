"""The programs a model is compiled into: one per kind and bucket.

- `prefill_t{tokens}_c{ctx}`: one decoder layer over a packed token bucket (any layer: weights are
  inputs, so one compiled program serves every layer and compile time does not grow with depth).
- `decode_b{rows}_c{ctx}`: one decoder layer over a batch bucket reading `ctx` cached tokens.
- `greedy_r{rows}` / `sample_r{rows}`: final norm, LM head and the on-device sampler.
- `encode_t{tokens}_w{window}` (runner "pooling", encoders): one encoder layer over sequences
  packed into windows of `window` tokens, each attending bidirectionally within itself, no KV
  cache.
- `verify_b{rows}_k{k}_c{ctx}`: one decoder layer over `rows` rows of `k + 1` tokens each (the
  newest and `k` drafted ones), each row reading `ctx` cached tokens (speculative decoding).
- A model whose layers differ in weight formats (`runtime/layer_groups.py`) has each layer kind
  once per layer group and bucket, the group after the name where it is not 0
  (`decode_b8_c1024_g1`), compiled from the group's configuration (`program_config`).
- `verify_greedy_r{rows}_k{k}` / `verify_sample_r{rows}_k{k}`: the head over those positions, with
  the acceptance step (`runtime/verify.py`).

Each kind's inputs are one record (`program_args.py`): the modules here rebuild it from their flat
call, and its example inputs and dynamic shapes follow from it; `backends.py` turns a program
into something callable (eagerly, or compiled ahead of time by Inductor).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn

from vllm_aot.kernels import (
    attention_impl,
    collectives,
    cpu_features,
    decode_attention_fn,
    experts_impl,
    experts_kernel,
    load_used,
    logprob_stats_kernel,
    logprobs_impl,
    prefill_attention_fn,
    prefill_attention_impl,
    sample_tokens_kernel,
    sampling_impl,
)
from vllm_aot.models.config import ModelArch
from vllm_aot.models.family import LayerParams, LayerSpec, no_reduce
from vllm_aot.models.formats import dense_format, weight_format
from vllm_aot.models.layers import (
    PagedKV,
    packed_attention,
    rms_norm,
    write_kv,
)
from vllm_aot.models.linear import LM_HEAD, vocab_rows_per_rank
from vllm_aot.models.registry import family_of
from vllm_aot.models.weights import LayerWeights
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.program_args import EncodeArgs, HeadArgs, LayerArgs, VerifyHeadArgs
from vllm_aot.runtime.sampler import mask_words, sample_rows
from vllm_aot.runtime.signature import Sizes, example, flatten, unflatten
from vllm_aot.runtime.signature import dynamic_shapes as record_dynamic_shapes
from vllm_aot.runtime.verify import accept_drafts


class ProgramKind(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    GREEDY = "greedy"
    SAMPLE = "sample"
    ENCODE = "encode"
    VERIFY = "verify"
    VERIFY_GREEDY = "verify_greedy"
    VERIFY_SAMPLE = "verify_sample"


LAYER_KINDS = (ProgramKind.PREFILL, ProgramKind.DECODE, ProgramKind.VERIFY)
GREEDY_KINDS = (ProgramKind.GREEDY, ProgramKind.VERIFY_GREEDY)


@dataclass(frozen=True, order=True)
class ProgramKey:
    kind: ProgramKind
    size: int  # tokens (prefill) or rows (decode, verify, heads)
    context_tokens: int = 0  # cached tokens read (layers only)
    num_drafts: int = 0  # drafted tokens per row (verify programs only)
    window: int = 0  # tokens a sequence may span, attending within them (encode programs only)
    group: int = 0  # the layer group whose layers it runs (layer programs only)

    @property
    def name(self) -> str:
        is_tokens = self.kind in (ProgramKind.PREFILL, ProgramKind.ENCODE)
        letter = "t" if is_tokens else ("b" if self.is_layer else "r")
        drafts = f"_k{self.num_drafts}" if self.num_drafts else ""
        context = f"_c{self.context_tokens}" if self.is_layer else ""
        window = f"_w{self.window}" if self.window else ""
        group = f"_g{self.group}" if self.group else ""
        return f"{self.kind.value}_{letter}{self.size}{drafts}{context}{window}{group}"

    @property
    def is_layer(self) -> bool:
        return self.kind in LAYER_KINDS

    @property
    def num_positions(self) -> int:
        """Tokens (head rows) per row: 1, or the newest plus the drafts of a verify program."""
        return self.num_drafts + 1


def all_program_keys(config: RuntimeConfig) -> list[ProgramKey]:
    if config.is_encoder_runner:
        return [
            ProgramKey(ProgramKind.ENCODE, t, window=w)
            for t in config.prefill_token_buckets
            for w in config.encode_windows(t)
        ]
    groups = range(config.num_layer_groups)
    keys = [
        ProgramKey(ProgramKind.PREFILL, t, c, group=g)
        for g in groups
        for t in config.prefill_token_buckets
        for c in config.prefill_context_buckets
    ]
    if config.runner == "pooling":  # a converted decoder: prefill alone, pooled on the host
        return keys
    keys += [
        ProgramKey(ProgramKind.DECODE, b, c, group=g)
        for g in groups
        for b in config.decode_batch_buckets
        for c in config.decode_context_buckets
    ]
    for kind in (ProgramKind.GREEDY, ProgramKind.SAMPLE):
        keys += [ProgramKey(kind, r) for r in config.head_row_buckets]
    k = config.num_speculative_tokens
    if k:
        keys += [
            ProgramKey(ProgramKind.VERIFY, b, c, k, group=g)
            for g in groups
            for b in config.verify_batch_buckets
            for c in config.decode_context_buckets
        ]
        for kind in (ProgramKind.VERIFY_GREEDY, ProgramKind.VERIFY_SAMPLE):
            keys += [ProgramKey(kind, b, 0, k) for b in config.verify_batch_buckets]
    return keys


def program_config(key: ProgramKey, config: RuntimeConfig) -> RuntimeConfig:
    """The configuration program `key` is built from and keyed by: a layer program's group's
    (`RuntimeConfig.for_group`: its formats, no groups), group 0's for the rest. A model of one
    group is its own."""
    return config.for_group(key.group if key.is_layer else 0)


def layer_spec(arch: ModelArch, config: RuntimeConfig) -> LayerSpec:
    """A rank's layer parameters (`ModelArch.for_rank`), each linear in the weight format the
    configuration gives it."""
    dense = dense_format(config.torch_dtype).name
    local = config.rank_arch(arch)
    return family_of(arch).layer_spec(local, dense).with_formats(config.linear_format)


def _reduce(config: RuntimeConfig):
    """What sums a rank's partial results: nothing on one rank, else the all-reduce op."""
    return collectives.all_reduce if config.tensor_parallel_size > 1 else no_reduce


def flatten_weights(weights: LayerWeights) -> tuple[torch.Tensor, ...]:
    """A layer's tensors as layer programs take them: in `LayerSpec.tensor_names` order."""
    return tuple(weights.values())


class Layer(nn.Module):
    """One decoder layer, the family's maths; prefill and decode differ only in how attention
    reads the cache. forward(*`LayerArgs`) -> (hidden, k_new, v_new).

    The layer writes its new K/V into its pools in place (`write_kv`) before attending:
    attention reads them from `k_new`/`v_new` all the same (the cached part's masks stop short
    of this step's positions), so writing first changes nothing it computes.
    """

    def __init__(self, arch: ModelArch, config: RuntimeConfig, *, kind: ProgramKind) -> None:
        super().__init__()
        self.arch = config.rank_arch(arch)
        self.reduce = _reduce(config)
        self.decoder_layer = family_of(arch).decoder_layer
        self.spec = layer_spec(arch, config)
        self.tensor_names = self.spec.tensor_names()
        cpu = cpu_features()
        formats = {linear.format for linear in self.spec.linears()}
        self.kernels = {name: weight_format(name).kernel(cpu) for name in formats}
        self.experts = experts_kernel(experts_impl())
        verify = kind == ProgramKind.VERIFY
        self.attention = (
            prefill_attention_fn(prefill_attention_impl())
            if kind == ProgramKind.PREFILL
            else decode_attention_fn(attention_impl(), verify=verify)
        )

    def forward(self, *flat: torch.Tensor):
        x: LayerArgs = unflatten(LayerArgs, flat)
        tensors = dict(zip(self.tensor_names, x.weights, strict=True))
        params = LayerParams(
            self.arch, self.spec, self.kernels, tensors, self.reduce, experts_kernel=self.experts
        )
        cache = PagedKV(x.k_pool, x.v_pool, x.k_scale, x.v_scale)

        def attend(q, k, v):
            write_kv(cache, x.step.slots, k, v)
            return self.attention(q, k, v, cache, x.step.context_blocks, x.step.context_mask)

        return self.decoder_layer(
            x.hidden, rope=(x.cos, x.sin), attend=attend, params=params, observe=self.observe
        )

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """Sees each sub-layer output (`family.Observe`); the accuracy tools' subclass records."""


class Encoder(nn.Module):
    """One encoder layer, the family's maths with bidirectional attention and no cache.
    forward(*`EncodeArgs`) -> (hidden,)."""

    def __init__(self, arch: ModelArch, config: RuntimeConfig) -> None:
        super().__init__()
        self.arch = arch
        self.layer = family_of(arch).decoder_layer
        self.spec = layer_spec(arch, config)
        self.tensor_names = self.spec.tensor_names()
        cpu = cpu_features()
        formats = {linear.format for linear in self.spec.linears()}
        self.kernels = {name: weight_format(name).kernel(cpu) for name in formats}

    def forward(self, *flat: torch.Tensor):
        x: EncodeArgs = unflatten(EncodeArgs, flat)
        tensors = dict(zip(self.tensor_names, x.weights, strict=True))
        params = LayerParams(self.arch, self.spec, self.kernels, tensors)

        def attend(q, k, v):
            return packed_attention(q, k, v, x.mask)

        out, _, _ = self.layer(x.hidden, rope=None, attend=attend, params=params, observe=_ignore)
        return (out,)  # programs return flat tuples (`backends.CompiledProgram`)


def _ignore(name: str, tensor: torch.Tensor) -> None:
    """Programs observe nothing (`family.Observe`)."""


class Head(nn.Module):
    """forward(*`HeadArgs`) -> the `SamplerOutput` fields, in order (a verify head's:
    forward(*`VerifyHeadArgs`) -> those of every position, then num_accepted). On several ranks
    the head's stored tensors are the rank's vocabulary rows; every rank's logits are gathered
    before the sampler, so each rank samples the same tokens (the same seeds over the same
    logits).

    The raw float32 logits are among the outputs because the sampler computes them anyway; the
    caller reads them only for rows processed on the host and for validation.
    """

    def __init__(self, arch: ModelArch, config: RuntimeConfig, *, kind: ProgramKind) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.vocab_size = arch.vocab_size
        self.world_size = config.tensor_parallel_size
        self.is_greedy = kind in GREEDY_KINDS
        self.is_verify = kind in (ProgramKind.VERIFY_GREEDY, ProgramKind.VERIFY_SAMPLE)
        self.num_logprobs = config.num_logprobs
        self.num_candidates = config.num_sampling_candidates
        fmt = weight_format(config.linear_format(LM_HEAD))
        self.linear = fmt.kernel(cpu_features()).apply
        self.stats = logprob_stats_kernel(logprobs_impl())  # None: the sampler's own
        self.draw = sample_tokens_kernel(sampling_impl())  # None: the sampler's own

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = unflatten(VerifyHeadArgs if self.is_verify else HeadArgs, flat)
        head: HeadArgs = x.head if self.is_verify else x
        normed = rms_norm(head.hidden, head.final_norm, self.eps)
        logits = self.linear(normed, *head.lm_head, None)
        if self.world_size > 1:  # each rank's vocabulary range, joined (the padding dropped)
            logits = collectives.all_gather(logits, self.world_size)[:, : self.vocab_size]
        logits = logits.float()
        settings = dict(
            is_greedy=self.is_greedy,
            num_logprobs=self.num_logprobs,
            num_candidates=self.num_candidates,
            stats=self.stats,
            draw=self.draw,
        )
        if self.is_verify:
            out, num_accepted = accept_drafts(logits, head.sampling, x.drafts, **settings)
            return (*out, num_accepted)
        return tuple(sample_rows(logits, head.sampling, **settings))


def build_module(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> nn.Module:
    load_used(config.formats_used())  # programs call our ops by name
    config = program_config(key, config)
    if key.kind is ProgramKind.ENCODE:
        return Encoder(arch, config)
    if key.is_layer:
        return Layer(arch, config, kind=key.kind)
    return Head(arch, config, kind=key.kind)


def args_type(key: ProgramKey) -> type:
    """The record of a program's inputs (`program_args.py`)."""
    if key.kind is ProgramKind.ENCODE:
        return EncodeArgs
    if key.is_layer:
        return LayerArgs
    return VerifyHeadArgs if key.num_drafts else HeadArgs


def example_args(key: ProgramKey, arch: ModelArch, config: RuntimeConfig):
    """The program's record holding inputs of its exact shapes and dtypes (values are
    irrelevant)."""
    return example(args_type(key), _sizes(key, arch, program_config(key, config)))


def example_inputs(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> tuple:
    """Inputs with the program's exact shapes and dtypes, flat, as it is called."""
    return flatten(example_args(key, arch, config))


def dynamic_shapes(key: ProgramKey, inputs: tuple):
    """What `torch.export` leaves symbolic in `inputs` (the KV pools' number of blocks)."""
    return record_dynamic_shapes(args_type(key), len(inputs))


def _sizes(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> Sizes:
    """The dimensions, dtypes and weights `program_args.py`'s names stand for in `key`."""
    tokens, rows, ctx = key.size * key.num_positions, key.size, key.context_tokens
    ctx_blocks = ctx // config.block_size
    is_prefill = key.kind is ProgramKind.PREFILL
    dims = {
        "tokens": tokens,
        "rows": rows,
        "hidden": arch.hidden_size,
        "head_dim": arch.head_dim,
        "block_size": config.block_size,
        "kv_heads": config.rank_arch(arch).num_kv_heads,
        "context_blocks": (ctx_blocks,) if is_prefill else (rows, ctx_blocks),
        "context_mask": (tokens, ctx + tokens) if is_prefill else (rows, ctx),
        "window": key.window,
        "windows": key.size // key.window if key.window else 0,
        "mask_words": mask_words(arch.vocab_size),
        "drafts": key.num_drafts,
    }
    dt = config.torch_dtype
    vocab_rows = vocab_rows_per_rank(arch.vocab_size, config.tensor_parallel_size)
    tensors = {
        "weights": lambda: flatten_weights(layer_spec(arch, config).example_tensors(dt)),
        "lm_head": lambda: weight_format(config.linear_format(LM_HEAD)).example(
            vocab_rows, arch.hidden_size
        ),
    }
    return Sizes(dims, {"model": dt, "kv": config.kv_torch_dtype}, tensors)
