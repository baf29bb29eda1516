"""CompiledModel: weights, one program per bucket, and the KV cache; runs one step at a time.

A step is all-prefill or all-decode, never mixed. The caller (a driver of `runtime/policy.py`:
the generate loop, teacher forcing, vLLM's scheduler through the plugin) decides what runs;
`prepare_prefill`/`prepare_decode` choose its layer program and pad to it; this class runs that
program (`inputs.key`, its layer group's) once per layer, each call writing its layer's new K/V
into the pools in place through the slot mapping (quantised with the layer's scales when the
pool is fp8: `models.layers.write_kv`), and samples in the head program.

A `Tap` (accuracy tooling) sees, and may replace, the tensors at program boundaries while
`tapped()` holds it; without one the step pays a single `is None` test per layer.

Observability: `num_executions` counts the layer passes and head runs per program, `step_stats`
the real vs padded rows, tokens and context tokens of each layer pass, `program_seconds` the
time inside programs (the layer loop, the head), and while `spans` is
enabled (a profiler records) every program call is a range named after its program, inside
ranges for the step's phases (`prepare_inputs`, `layers`, `prepare_sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple, Protocol

import torch

from vllm_aot.kernels import collectives
from vllm_aot.models.config import ModelArch
from vllm_aot.models.layers import rms_norm, rotary_cos_sin
from vllm_aot.models.weights import ModelWeights
from vllm_aot.runtime.backends import Program
from vllm_aot.runtime.buckets import fitting_bucket
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.inputs import (
    DecodeInputs,
    DecodeRow,
    GivenEmbeds,
    PrefillChunk,
    RowSampling,
    VerifyInputs,
    VerifyRow,
    prefill_pieces,
    prepare_decode,
    prepare_prefill,
    prepare_sampling,
    prepare_verify,
)
from vllm_aot.runtime.kv_cache import KVCache
from vllm_aot.runtime.profiling import Spans
from vllm_aot.runtime.program_args import HeadArgs, LayerArgs, LayerStep, VerifyHeadArgs
from vllm_aot.runtime.programs import ProgramKey, ProgramKind, flatten_weights
from vllm_aot.runtime.sampler import (
    GREEDY,
    SamplerOutput,
    SamplingTensors,
    all_greedy,
    token_mask,
)
from vllm_aot.runtime.signature import flat_call, flatten
from vllm_aot.runtime.step_stats import StepStats
from vllm_aot.runtime.verify import DraftTensors

_LAYER_CALL = flat_call(LayerArgs)


class Tap(Protocol):
    """Sees, and may replace, one program-boundary tensor of a step (accuracy tooling).

    Called inside `CompiledModel.tapped()` with HF's module names: `model.embed_tokens` (after the
    embedding), then per layer `model.layers.{i}.self_attn.key_states` and `.value_states` (the
    layer program's new K/V, post-rotary, before they are written to the cache) and
    `model.layers.{i}` (the layer's output hidden state). `tensor`'s first dimension is the step's
    padded tokens; `positions` [real tokens] are the sequence positions of its first rows (the
    rest is padding). Returns the tensor the step continues with (`tensor` itself, or a
    replacement of the same shape and dtype).
    """

    def __call__(
        self, *, name: str, tensor: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor: ...


class PrefillHidden(NamedTuple):
    """A prefill step's final hidden states (before the final norm)."""

    last: torch.Tensor  # [row bucket, hidden]: each chunk's last token, the head's rows
    tokens: torch.Tensor  # [real tokens, hidden]: every chunk's tokens, packed in chunk order


class CompiledModel:
    def __init__(
        self,
        arch: ModelArch,
        config: RuntimeConfig,
        weights: ModelWeights,
        programs: Mapping[ProgramKey, Program],
        *,
        num_kv_blocks: int | None = None,
    ) -> None:
        """`num_kv_blocks` sizes the KV pool (default: the config's); programs ignore it."""
        self.arch = arch
        self.config = config
        self.weights = weights
        self.programs = dict(programs)
        self.kv = KVCache(
            config.rank_arch(arch),  # the rank's KV heads
            num_blocks=num_kv_blocks or config.total_kv_blocks,
            block_size=config.block_size,
            dtype=config.kv_torch_dtype,
            scales=weights.kv_scales,
        )
        self._layer_weights = [flatten_weights(w) for w in weights.layers]
        self._layer_groups = [config.layer_group(i) for i in range(len(weights.layers))]
        # cos and sin of every position a step may hold (a verify row's padded drafts run up
        # to k past the last one), computed once: two lookups a step instead of seven ops.
        positions = torch.arange(config.max_model_len + config.num_speculative_tokens + 1)
        self._cos, self._sin = rotary_cos_sin(positions, arch.rope.inv_freq(), config.torch_dtype)
        self.num_executions: dict[ProgramKey, int] = dict.fromkeys(self.programs, 0)
        self.step_stats = StepStats()
        # Wall seconds inside the layer loop (the 30 program calls) and the head programs.
        self.program_seconds: dict[str, float] = {"layers": 0.0, "head": 0.0}
        self.spans = Spans()
        self._tap: Tap | None = None

    @contextmanager
    def tapped(self, tap: Tap) -> Iterator[None]:
        """Steps run inside the block call `tap` at program boundaries; taps do not nest."""
        assert self._tap is None, "a tap is already installed; taps do not nest"
        self._tap = tap
        try:
            yield
        finally:
            self._tap = None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup layer programs start from: [n] -> [n, hidden], model dtype. On
        several ranks each looks up the ids in its vocabulary range (zeros for the rest) and
        the ranks' rows are summed."""
        dtype = self.config.torch_dtype
        if self.weights.rank.size == 1:
            return self.weights.embed.rows(token_ids, dtype)
        first, end = self.weights.vocab_range()
        mine = (token_ids >= first) & (token_ids < end)
        rows = self.weights.embed.rows(torch.where(mine, token_ids - first, 0), dtype)
        return collectives.all_reduce(rows * mine.unsqueeze(1).to(dtype))

    def _program(self, key: ProgramKey) -> Program:
        """The program for `key`, counted once per step; each call a named span when profiled."""
        self.num_executions[key] += 1
        return self.spans.wrap(self.programs[key], key.name)

    def _run_layers(
        self,
        key: ProgramKey,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        step: LayerStep,
        num_real: int,
        given: GivenEmbeds | None = None,
    ) -> torch.Tensor:
        """Embed (or take the `given` embeddings), run every layer through its layer group's
        program for this bucket (`key` of each group); [tokens, hidden].
        `step` is what every layer reads alike.

        The first `num_real` tokens are real, the rest padding (only taps need to know).
        """
        groups = range(self.config.num_layer_groups)
        programs = [self._program(replace(key, group=g) if g else key) for g in groups]
        with self.spans("layers"):  # embedding and rotary included
            hidden = self.embed(token_ids)
            if given is not None:
                hidden = hidden.index_copy(0, given.rows, given.values.to(hidden.dtype))
            tap, real_positions = self._tap, positions[:num_real]
            if tap is not None:
                hidden = tap(name="model.embed_tokens", tensor=hidden, positions=real_positions)
            cos, sin = self._cos[positions], self._sin[positions]
            started = time.perf_counter()
            for layer, weights in enumerate(self._layer_weights):
                cache = self.kv.layer(layer)
                args = _LAYER_CALL(
                    hidden=hidden,
                    cos=cos,
                    sin=sin,
                    k_pool=cache.k,
                    v_pool=cache.v,
                    k_scale=cache.k_scale,
                    v_scale=cache.v_scale,
                    step=step,
                    weights=weights,
                )
                # its K/V written into `cache`
                hidden, k_new, v_new = programs[self._layer_groups[layer]](*args)
                if tap is not None:
                    hidden = self._tap_layer(
                        tap, layer, hidden, (k_new, v_new), step.slots, real_positions
                    )
            self.program_seconds["layers"] += time.perf_counter() - started
        return hidden

    def _tap_layer(self, tap: Tap, layer: int, hidden, kv, slot_mapping, positions):
        """The tap's view of a layer's outputs; K/V it replaces overwrite what the program
        wrote (later steps read them, as they read the replaced hidden state's successors)."""
        k_new, v_new = kv
        prefix = f"model.layers.{layer}"
        k_tap = tap(name=f"{prefix}.self_attn.key_states", tensor=k_new, positions=positions)
        v_tap = tap(name=f"{prefix}.self_attn.value_states", tensor=v_new, positions=positions)
        if k_tap is not k_new or v_tap is not v_new:
            self.kv.write(layer, slot_mapping, k_tap, v_tap)
        return tap(name=prefix, tensor=hidden, positions=positions)

    def sample(self, hidden: torch.Tensor, sampling: Sequence[RowSampling]) -> SamplerOutput:
        """Head program over hidden: [row bucket, hidden]; outputs for the real rows only.

        The greedy variant runs when every row is greedy, the sampling variant otherwise.
        """
        num_rows = hidden.shape[0]
        kind = ProgramKind.GREEDY if all_greedy(r.params for r in sampling) else ProgramKind.SAMPLE
        with self.spans("prepare_sampling"):
            tensors = prepare_sampling(sampling, num_rows, self.arch.vocab_size)
        args = self._head_args(hidden, tensors)
        program = self._program(ProgramKey(kind, num_rows))
        started = time.perf_counter()
        out = program(*flatten(args))
        self.program_seconds["head"] += time.perf_counter() - started
        return SamplerOutput(*(t[: len(sampling)] for t in out))

    def _prefill_layers(self, chunks: Sequence[PrefillChunk]):
        """Layers over the packed chunks: (hidden [token bucket, hidden], the padded inputs)."""
        with self.spans("prepare_inputs"):
            inputs = prepare_prefill(chunks, self.config)
        key = inputs.key
        num_real = sum(len(c.token_ids) for c in chunks)
        self.step_stats.record(
            "prefill",
            num_rows=len(chunks),
            row_bucket=inputs.num_rows,
            num_tokens=num_real,
            token_bucket=key.size,
            num_context_tokens=sum(c.num_cached for c in chunks),
            context_bucket=key.context_tokens,
        )
        step = LayerStep(
            context_blocks=inputs.context_block_ids,
            context_mask=inputs.attn_mask,
            slots=inputs.slot_mapping,
        )
        hidden = self._run_layers(
            key, inputs.token_ids, inputs.positions, step, num_real, inputs.given_embeds
        )
        return hidden, inputs

    def forward_prefill(self, chunks: Sequence[PrefillChunk]) -> PrefillHidden:
        """Layers of a prefill step; each chunk's last hidden state (the head's rows) and every
        token's (prompt logprobs). A chunk its bucket would pad more than more calls cost runs
        as pieces (`prefill_pieces`), the last piece's last token being the chunk's."""
        tokens = []
        for piece in prefill_pieces(chunks, self.config):
            hidden, inputs = self._prefill_layers(piece)
            tokens.append(hidden[: sum(len(c.token_ids) for c in piece)])
        last = hidden[inputs.logits_indices]
        return PrefillHidden(last, tokens[0] if len(tokens) == 1 else torch.cat(tokens))

    def prefill_states(self, chunks: Sequence[PrefillChunk]) -> list[torch.Tensor]:
        """A prefill step for pooling (a decoder under `convert` "embed"): each chunk's token
        states after the final norm, [its tokens, hidden]; the K/V land in the cache as in any
        prefill step (a prompt's later chunks read them)."""
        hidden, _ = self._prefill_layers(chunks)
        num_real = sum(len(c.token_ids) for c in chunks)
        normed = rms_norm(hidden[:num_real], self.weights.final_norm, self.arch.rms_norm_eps)
        return list(normed.split([len(c.token_ids) for c in chunks]))

    def forward_decode(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Layers of a decode step; [row bucket, hidden]."""
        with self.spans("prepare_inputs"):
            inputs = prepare_decode(rows, self.config)
        key = inputs.key
        self.step_stats.record(
            "decode",
            num_rows=len(rows),
            row_bucket=key.size,
            num_tokens=len(rows),
            token_bucket=key.size,
            num_context_tokens=sum(r.position for r in rows),
            context_bucket=key.size * key.context_tokens,
        )
        return self._run_layers(
            key,
            inputs.token_ids,
            inputs.positions,
            _step(inputs),
            len(rows),
        )

    def forward_verify(self, rows: Sequence[VerifyRow]) -> tuple[torch.Tensor, VerifyInputs]:
        """Layers of a verify step (speculative decoding): (hidden [row bucket * (k + 1),
        hidden], the padded inputs, whose drafts `sample_verify` takes)."""
        with self.spans("prepare_inputs"):
            inputs = prepare_verify(rows, self.config)
        key = inputs.key
        self.step_stats.record(
            "verify",
            num_rows=len(rows),
            row_bucket=key.size,
            num_tokens=sum(len(r.token_ids) for r in rows),
            token_bucket=key.size * key.num_positions,
            num_context_tokens=sum(r.position for r in rows),
            context_bucket=key.size * key.context_tokens,
        )
        num_real = key.size * key.num_positions  # real rows' padded positions included
        hidden = self._run_layers(key, inputs.token_ids, inputs.positions, _step(inputs), num_real)
        return hidden, inputs

    def sample_verify(
        self, hidden: torch.Tensor, inputs: VerifyInputs, sampling: Sequence[RowSampling]
    ) -> tuple[SamplerOutput, torch.Tensor]:
        """The verify head over `forward_verify`'s hidden states: (every position's outputs,
        [row bucket * (k + 1)] row-major, and num_accepted [real rows]); see `runtime/verify.py`.
        `sampling[i].position` is the position of row i's first sampled token."""
        key = inputs.key
        is_greedy = all_greedy(r.params for r in sampling)
        kind = ProgramKind.VERIFY_GREEDY if is_greedy else ProgramKind.VERIFY_SAMPLE
        with self.spans("prepare_sampling"):
            tensors = prepare_sampling(sampling, key.size, self.arch.vocab_size)
        drafts = DraftTensors(token_ids=inputs.draft_ids, num_drafts=inputs.num_drafts)
        args = VerifyHeadArgs(head=self._head_args(hidden, tensors), drafts=drafts)
        program = self._program(ProgramKey(kind, key.size, 0, key.num_drafts))
        *out, num_accepted = program(*flatten(args))
        return SamplerOutput(*out), num_accepted[: len(sampling)]

    def _head_args(self, hidden: torch.Tensor, sampling: SamplingTensors) -> HeadArgs:
        w = self.weights
        return HeadArgs(
            hidden=hidden,
            final_norm=w.final_norm,
            lm_head=tuple(w.lm_head.tensors),
            sampling=sampling,
        )

    def prefill(
        self, chunks: Sequence[PrefillChunk], sampling: Sequence[RowSampling]
    ) -> SamplerOutput:
        """Run a prefill step; one sampled row per chunk (its last token)."""
        assert len(chunks) == len(sampling), "one sampling row per chunk"
        return self.sample(self.forward_prefill(chunks).last, sampling)

    def decode(self, rows: Sequence[DecodeRow], sampling: Sequence[RowSampling]) -> SamplerOutput:
        """Run a decode step: one new token per row."""
        assert len(rows) == len(sampling), "one sampling row per decode row"
        return self.sample(self.forward_decode(rows), sampling)

    def head_rows(self, hidden: torch.Tensor, sampling: Sequence[RowSampling]) -> SamplerOutput:
        """Head programs over any number of rows, hidden [n, hidden]: slices of the largest row
        bucket, the last padded to the smallest that fits; outputs for the n rows."""
        assert len(sampling) == hidden.shape[0], "one sampling row per hidden row"
        largest = max(self.config.head_row_buckets)
        parts = []
        for start in range(0, hidden.shape[0], largest):
            part = hidden[start : start + largest]
            num_rows = fitting_bucket(self.config.head_row_buckets, part.shape[0])
            padded = part.new_zeros(num_rows, part.shape[1])
            padded[: part.shape[0]] = part
            parts.append(self.sample(padded, sampling[start : start + largest]))
        return SamplerOutput(*(torch.cat(field) for field in zip(*parts, strict=True)))

    def score(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> SamplerOutput:
        """The raw logprob and 1-based rank of `token_ids[i]` after row i of hidden [n, hidden],
        with the top-n, as generation returns them for a sampled token (prompt logprobs).

        The greedy head programs run with each row's vocabulary narrowed to its token, so the
        token they pick is the given one; their logprob statistics describe the raw logits,
        before the mask."""
        vocab_size = self.arch.vocab_size
        sampling = [RowSampling(GREEDY, 0, 0, token_mask(t, vocab_size)) for t in token_ids]
        return self.head_rows(hidden, sampling)

    def prefill_logits(self, chunk: PrefillChunk) -> torch.Tensor:
        """Logits at every position of one chunk, [tokens, vocab] float32 (for validation).

        Runs the same layer and head programs a prefill step runs, the head over slices of rows.
        """
        hidden = self.forward_prefill([chunk]).tokens
        return self.head_rows(hidden, [RowSampling(GREEDY, 0, 0)] * hidden.shape[0]).logits


def _step(inputs: DecodeInputs | VerifyInputs) -> LayerStep:
    """What every layer of a decode or verify step reads alike."""
    return LayerStep(
        context_blocks=inputs.block_tables,
        context_mask=inputs.context_mask,
        slots=inputs.slot_mapping,
    )
