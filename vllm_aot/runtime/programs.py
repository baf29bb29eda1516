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
- `verify_greedy_r{rows}_k{k}` / `verify_sample_r{rows}_k{k}`: the head over those positions, with
  the acceptance step (`runtime/verify.py`).

Each program states its example inputs here, once; `backends.py` turns a program into something
callable (eagerly, or compiled ahead of time by Inductor).
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
from vllm_aot.runtime.sampler import SamplingTensors, mask_words, sample_rows
from vllm_aot.runtime.verify import DraftTensors, accept_drafts


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

    @property
    def name(self) -> str:
        is_tokens = self.kind in (ProgramKind.PREFILL, ProgramKind.ENCODE)
        letter = "t" if is_tokens else ("b" if self.is_layer else "r")
        drafts = f"_k{self.num_drafts}" if self.num_drafts else ""
        context = f"_c{self.context_tokens}" if self.is_layer else ""
        window = f"_w{self.window}" if self.window else ""
        return f"{self.kind.value}_{letter}{self.size}{drafts}{context}{window}"

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
    keys = [
        ProgramKey(ProgramKind.PREFILL, t, c)
        for t in config.prefill_token_buckets
        for c in config.prefill_context_buckets
    ]
    if config.runner == "pooling":  # a converted decoder: prefill alone, pooled on the host
        return keys
    keys += [
        ProgramKey(ProgramKind.DECODE, b, c)
        for b in config.decode_batch_buckets
        for c in config.decode_context_buckets
    ]
    for kind in (ProgramKind.GREEDY, ProgramKind.SAMPLE):
        keys += [ProgramKey(kind, r) for r in config.head_row_buckets]
    k = config.num_speculative_tokens
    if k:
        keys += [
            ProgramKey(ProgramKind.VERIFY, b, c, k)
            for b in config.verify_batch_buckets
            for c in config.decode_context_buckets
        ]
        for kind in (ProgramKind.VERIFY_GREEDY, ProgramKind.VERIFY_SAMPLE):
            keys += [ProgramKey(kind, b, 0, k) for b in config.verify_batch_buckets]
    return keys


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
    reads the cache.

    forward(hidden, cos, sin, k_pool, v_pool, k_scale, v_scale, ctx_a, ctx_b, slots, *weights)
    -> (hidden, k_new, v_new), where the pools are in the KV cache dtype and the scales float32
    scalars (`models.layers.PagedKV`: inputs, since one program serves every layer),
    (ctx_a, ctx_b) is (context_block_ids, attn_mask) for prefill and (block_tables,
    context_mask) for decode and verify, `slots` [tokens] where each token's K/V go in the
    layer's pools, and `weights` follow `LayerSpec.tensor_names`.

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

    def forward(
        self, hidden, cos, sin, k_pool, v_pool, k_scale, v_scale, ctx_a, ctx_b, slots, *weights
    ):
        tensors = dict(zip(self.tensor_names, weights, strict=True))
        params = LayerParams(
            self.arch, self.spec, self.kernels, tensors, self.reduce, experts_kernel=self.experts
        )
        cache = PagedKV(k_pool, v_pool, k_scale, v_scale)

        def attend(q, k, v):
            write_kv(cache, slots, k, v)
            return self.attention(q, k, v, cache, ctx_a, ctx_b)

        return self.decoder_layer(
            hidden, rope=(cos, sin), attend=attend, params=params, observe=self.observe
        )

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        """Sees each sub-layer output (`family.Observe`); the accuracy tools' subclass records."""


class Encoder(nn.Module):
    """One encoder layer, the family's maths with bidirectional attention and no cache.

    forward(hidden [tokens, hidden], mask [windows, window, window] bool, *weights) -> (hidden,),
    where `mask` is True where a key of the window is visible (`models.layers.packed_attention`).
    """

    def __init__(self, arch: ModelArch, config: RuntimeConfig) -> None:
        super().__init__()
        self.arch = arch
        self.layer = family_of(arch).decoder_layer
        self.spec = layer_spec(arch, config)
        self.tensor_names = self.spec.tensor_names()
        cpu = cpu_features()
        formats = {linear.format for linear in self.spec.linears()}
        self.kernels = {name: weight_format(name).kernel(cpu) for name in formats}

    def forward(self, hidden, mask, *weights):
        tensors = dict(zip(self.tensor_names, weights, strict=True))
        params = LayerParams(self.arch, self.spec, self.kernels, tensors)

        def attend(q, k, v):
            return packed_attention(q, k, v, mask)

        out, _, _ = self.layer(hidden, rope=None, attend=attend, params=params, observe=_ignore)
        return (out,)  # programs return flat tuples (`backends.CompiledProgram`)


def _ignore(name: str, tensor: torch.Tensor) -> None:
    """Programs observe nothing (`family.Observe`)."""


class Head(nn.Module):
    """(hidden, final_norm, *lm_head, *SamplingTensors) -> the `SamplerOutput` fields, in order,
    where `lm_head` is the head's stored tensors in its weight format: on several ranks, the
    rank's vocabulary rows; every rank's logits are gathered before the sampler, so each rank
    samples the same tokens (the same seeds over the same logits).

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
        self.num_head_tensors = len(fmt.tensor_names)
        self.linear = fmt.kernel(cpu_features()).apply
        self.stats = logprob_stats_kernel(logprobs_impl())  # None: the sampler's own
        self.draw = sample_tokens_kernel(sampling_impl())  # None: the sampler's own

    def forward(self, hidden, final_norm, *rest) -> tuple[torch.Tensor, ...]:
        lm_head, sampling = rest[: self.num_head_tensors], rest[self.num_head_tensors :]
        num_fields = len(SamplingTensors._fields)
        t = SamplingTensors(*sampling[:num_fields])
        logits = self.linear(rms_norm(hidden, final_norm, self.eps), *lm_head, None)
        if self.world_size > 1:  # each rank's vocabulary range, joined (the padding dropped)
            logits = collectives.all_gather(logits, self.world_size)[:, : self.vocab_size]
        logits = logits.float()
        settings = dict(
            is_greedy=self.is_greedy,
            num_logprobs=self.num_logprobs,
            num_candidates=self.num_candidates,
            stats=self.stats,
        )
        if self.is_verify:
            out, num_accepted = accept_drafts(
                logits, t, DraftTensors(*sampling[num_fields:]), **settings
            )
            return (*out, num_accepted)
        return tuple(sample_rows(logits, t, draw=self.draw, **settings))


def build_module(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> nn.Module:
    load_used(config.formats_used())  # programs call our ops by name
    if key.kind is ProgramKind.ENCODE:
        return Encoder(arch, config)
    if key.is_layer:
        return Layer(arch, config, kind=key.kind)
    return Head(arch, config, kind=key.kind)


def example_inputs(key: ProgramKey, arch: ModelArch, config: RuntimeConfig) -> tuple:
    """Inputs with the program's exact shapes and dtypes (values are irrelevant)."""
    dt = config.torch_dtype
    i64 = torch.int64
    if key.kind is ProgramKind.ENCODE:
        window = key.window
        return (
            torch.zeros(key.size, arch.hidden_size, dtype=dt),
            torch.ones(key.size // window, window, window, dtype=torch.bool),
            *flatten_weights(layer_spec(arch, config).example_tensors(dt)),
        )
    if key.is_layer:
        n = key.size * key.num_positions  # tokens
        rows = key.size
        bs = config.block_size
        local = config.rank_arch(arch)
        pool = (2, bs, local.num_kv_heads, local.head_dim)  # dim 0 is dynamic: the pool's size
        weights = layer_spec(arch, config).example_tensors(dt)
        ctx_blocks = key.context_tokens // bs
        if key.kind is ProgramKind.PREFILL:
            ctx = (
                torch.zeros(ctx_blocks, dtype=i64),
                torch.ones(n, key.context_tokens + n, dtype=torch.bool),
            )
        else:
            ctx = (
                torch.zeros(rows, ctx_blocks, dtype=i64),
                torch.ones(rows, key.context_tokens, dtype=torch.bool),
            )
        return (
            torch.zeros(n, arch.hidden_size, dtype=dt),
            torch.ones(n, arch.head_dim, dtype=dt),
            torch.zeros(n, arch.head_dim, dtype=dt),
            torch.zeros(pool, dtype=config.kv_torch_dtype),
            torch.zeros(pool, dtype=config.kv_torch_dtype),
            torch.ones((), dtype=torch.float32),
            torch.ones((), dtype=torch.float32),
            *ctx,
            torch.zeros(n, dtype=i64),
            *flatten_weights(weights),
        )
    rows = key.size
    lm_head = weight_format(config.linear_format(LM_HEAD))
    drafts = (
        (torch.zeros(rows, key.num_drafts, dtype=i64), torch.zeros(rows, dtype=i64))
        if key.num_drafts
        else ()
    )
    return (
        torch.zeros(rows * key.num_positions, arch.hidden_size, dtype=dt),
        torch.ones(arch.hidden_size, dtype=dt),
        *lm_head.example(
            vocab_rows_per_rank(arch.vocab_size, config.tensor_parallel_size), arch.hidden_size
        ),
        torch.ones(rows),
        torch.zeros(rows, dtype=i64),
        torch.ones(rows),
        torch.zeros(rows),
        torch.zeros(rows, dtype=i64),
        torch.zeros(rows, dtype=i64),
        torch.full((rows, mask_words(arch.vocab_size)), -1, dtype=torch.int32),
        *drafts,
    )


def dynamic_shapes(key: ProgramKey, inputs: tuple):
    """Only the KV pools' first dimension (number of blocks) varies; all else is static."""
    if not key.is_layer:
        return None
    num_blocks = torch.export.Dim("num_blocks", min=2, max=1 << 24)
    # forward(hidden, cos, sin, k_pool, v_pool, k_scale, v_scale, ctx_a, ctx_b, slots, *weights)
    pools = ({0: num_blocks}, {0: num_blocks})
    fixed = (None, None, None, *pools, None, None, None, None, None)
    return (*fixed, tuple(None for _ in inputs[len(fixed) :]))
