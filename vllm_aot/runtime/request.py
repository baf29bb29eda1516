"""RequestState: one request as every driver of the model tracks it between steps.

The generate loop, teacher forcing and the plugin's runner (`plugin/requests.CachedRequest`
extends it) keep the same fields; the scheduling policy reads them as a `policy.RequestView`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.sampler import SamplingParams


@dataclass(kw_only=True)
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # tokens it may generate
    sampling: SamplingParams  # normalised
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # generated (or fed) after the prompt
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # [blocks covering the computed tokens]
    # [prompt tokens, hidden]: a prompt given as embeddings (prompt_token_ids: placeholders)
    prompt_embeds: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt's tokens, then the generated ones."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def tokens(self, start: int, stop: int) -> list[int]:
        return [self.token(p) for p in range(start, stop)]

    def prefill_chunk(self, positions: range) -> PrefillChunk:
        """The tokens at `positions` (starting at num_computed_tokens) as one prefill chunk."""
        assert positions.start == self.num_computed_tokens, "a chunk continues the cached tokens"
        embeds = None
        if self.prompt_embeds is not None and positions.start < self.num_prompt_tokens:
            embeds = self.prompt_embeds[positions.start : positions.stop]
        return PrefillChunk(
            self.tokens(positions.start, positions.stop), positions.start, self.block_table, embeds
        )

    def decode_row(self) -> DecodeRow:
        """The newest token, the one not yet in the cache, as a decode row."""
        position = self.num_tokens - 1
        assert position == self.num_computed_tokens, "a decode row is the only uncomputed token"
        return DecodeRow(self.token(position), position, self.block_table)

    def row_sampling(self, position: int) -> RowSampling:
        """How to sample the token at `position`."""
        return RowSampling(self.sampling, self.seed, position)
