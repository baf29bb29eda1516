"""EncoderModel: an encoder's weights and its encode programs (runner "pooling"); runs whole
sequences, several packed in one token bucket a step, and pools each into its embedding.

A step: `prepare_encode` packs the sequences into the windows of an encode program (the
smallest token bucket, then the narrowest window holding the longest sequence; none across a
window's edge) and builds the bidirectional mask (each token sees its own sequence); the
family's embedding stage runs on the host (`Family.embed`: word, position and token-type rows,
a LayerNorm), then the step's `encode_t{T}_w{W}` program once per layer. There is no KV cache:
nothing is written, so nothing is kept between steps. Counters and spans are `CompiledModel`'s
(`num_executions`, `step_stats`, `program_seconds`, `spans`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from vllm_aot.models.config import ModelArch
from vllm_aot.models.pooling import Pooling, pool
from vllm_aot.models.registry import family_of
from vllm_aot.models.weights import ModelWeights
from vllm_aot.runtime.backends import Program
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.encode_inputs import EncoderSequence, encode_steps, prepare_encode
from vllm_aot.runtime.profiling import Spans
from vllm_aot.runtime.program_args import EncodeArgs
from vllm_aot.runtime.programs import ProgramKey, flatten_weights
from vllm_aot.runtime.signature import flatten
from vllm_aot.runtime.step_stats import StepStats


class EncoderModel:
    def __init__(
        self,
        arch: ModelArch,
        config: RuntimeConfig,
        weights: ModelWeights,
        programs: Mapping[ProgramKey, Program],
    ) -> None:
        assert arch.is_encoder, f"{arch.architecture} is not an encoder"
        self.arch = arch
        self.config = config
        self.weights = weights
        self.programs = dict(programs)
        self.family = family_of(arch)
        self._layer_weights = [flatten_weights(w) for w in weights.layers]
        self.num_executions: dict[ProgramKey, int] = dict.fromkeys(self.programs, 0)
        self.step_stats = StepStats()
        self.program_seconds: dict[str, float] = {"layers": 0.0, "head": 0.0}  # no head
        self.spans = Spans()

    def encode(self, sequences: Sequence[EncoderSequence]) -> list[torch.Tensor]:
        """One step: each sequence's last hidden states [its tokens, hidden] (model dtype).
        Raises ValueError naming the largest bucket when the sequences do not fit one."""
        with self.spans("prepare_inputs"):
            inputs = prepare_encode(sequences, self.config)
        key = inputs.key
        num_tokens = sum(len(s.token_ids) for s in sequences)
        self.step_stats.record(
            "encode",
            num_rows=len(sequences),
            row_bucket=len(sequences),
            num_tokens=num_tokens,
            token_bucket=key.size,
            num_context_tokens=0,
            context_bucket=0,
        )
        self.num_executions[key] += 1
        program = self.spans.wrap(self.programs[key], key.name)
        with self.spans("layers"):
            words = self.weights.embed.rows(inputs.token_ids, self.config.torch_dtype)
            hidden = self.family.embed(
                self.arch,
                words,
                self.weights.embed_extras,
                inputs.positions,
                inputs.token_type_ids,
            )
            started = time.perf_counter()
            for weights in self._layer_weights:
                args = EncodeArgs(hidden=hidden, mask=inputs.attn_mask, weights=weights)
                (hidden,) = program(*flatten(args))
            self.program_seconds["layers"] += time.perf_counter() - started
        return [
            hidden[start : start + len(s.token_ids)]
            for start, s in zip(inputs.starts, sequences, strict=True)
        ]

    def steps(self, sequences: Sequence[EncoderSequence]) -> list[list[int]]:
        """The sequences (their indices) grouped into steps (`inputs.encode_steps`). Raises
        ValueError for a sequence no bucket holds alone (naming the limit), or an empty one."""
        limit = min(max(self.config.prefill_token_buckets), self.config.max_model_len)
        for seq in sequences:
            if not 0 < len(seq.token_ids) <= limit:
                raise ValueError(
                    f"a sequence of {len(seq.token_ids)} tokens cannot be encoded: 1 to {limit} "
                    "tokens (max_model_len and the largest encode bucket) are supported"
                )
        return encode_steps([len(s.token_ids) for s in sequences], self.config)

    def embed(self, sequences: Sequence[EncoderSequence], pooling: Pooling) -> torch.Tensor:
        """Each sequence's pooled embedding, [sequences, hidden] float32, in as few steps as
        the largest bucket allows."""
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for group in self.steps(sequences):
            for i, states in zip(group, self.encode([sequences[i] for i in group]), strict=True):
                out[i] = pool(states, pooling)
        return torch.stack(out)
