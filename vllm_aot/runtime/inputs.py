"""Step descriptions in, padded bucket tensors out (`prepare_*`).

The layer program a step runs is chosen here, once (`prefill_key`, `decode_key`), and carried
in the inputs as `key`; the tensors are padded to its shapes. Padding is decided here too:
padded tokens get position 0, the dummy block's slot and a sequence id of their own; padded
block-table entries point at the dummy block and are masked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vllm_aot.runtime.buckets import bucket_split, fitting_bucket
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.kv_cache import DUMMY_BLOCK, blocks_needed
from vllm_aot.runtime.programs import ProgramKey, ProgramKind
from vllm_aot.runtime.sampler import SamplingParams, SamplingTensors, mask_words

_PAD_SEQ = -1  # sequence id of the first padded query token, -2 the next, ... (each sees itself)
_PAD_KEY_SEQ = 1 << 62  # sequence id of padded cached keys (nobody sees them)


@dataclass(frozen=True)
class PrefillChunk:
    """New tokens of one sequence for a prefill step."""

    token_ids: Sequence[int]
    num_cached: int  # tokens of this sequence already in the KV cache (prefix hit, earlier chunk)
    block_table: Sequence[int]  # covers num_cached + len(token_ids) tokens
    # [k <= tokens, hidden]: the first k tokens' inputs, given in place of their embeddings
    # (a prompt given as embeddings; token_ids hold placeholders there)
    embeds: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeRow:
    """One sequence's next token for a decode step."""

    token_id: int
    position: int  # of token_id, which is also the number of tokens already cached
    block_table: Sequence[int]  # covers position + 1 tokens


@dataclass(frozen=True)
class VerifyRow:
    """One sequence's newest token and its drafts for a verify step (speculative decoding)."""

    token_ids: Sequence[int]  # the newest token, then up to k drafted ones
    position: int  # of token_ids[0], which is also the number of tokens already cached
    block_table: Sequence[int]  # covers position + len(token_ids) tokens


@dataclass(frozen=True)
class RowSampling:
    """How to sample one head row."""

    params: SamplingParams  # normalised
    seed: int
    position: int  # position of the token being sampled
    vocab_mask: torch.Tensor | None = None  # [ceil(vocab / 32)] int32, None = all allowed


class GivenEmbeds(NamedTuple):
    """Step tokens whose inputs are given embeddings instead of their token's embedding."""

    rows: torch.Tensor  # [k] int64: token rows of the step
    values: torch.Tensor  # [k, hidden]


class PrefillInputs(NamedTuple):
    key: ProgramKey  # prefill_t{tokens}_c{ctx_blocks * block_size}
    num_rows: int  # the head's row bucket: chunks, padded
    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    slot_mapping: torch.Tensor  # [tokens]
    context_block_ids: torch.Tensor  # [ctx_blocks]
    attn_mask: torch.Tensor  # [tokens, ctx_blocks * block_size + tokens] bool
    logits_indices: torch.Tensor  # [rows]: last token of each chunk
    given_embeds: GivenEmbeds | None = None  # None: every token's input is its embedding


class DecodeInputs(NamedTuple):
    key: ProgramKey  # decode_b{rows}_c{ctx_blocks * block_size}
    token_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [rows, ctx_blocks]
    context_mask: torch.Tensor  # [rows, ctx_blocks * block_size] bool


class VerifyInputs(NamedTuple):
    key: ProgramKey  # verify_b{rows}_k{k}_c{ctx_blocks * block_size}
    token_ids: torch.Tensor  # [rows * (k + 1)], row-major by row then position
    positions: torch.Tensor  # [rows * (k + 1)]
    slot_mapping: torch.Tensor  # [rows * (k + 1)]: padded positions to the dummy block
    block_tables: torch.Tensor  # [rows, ctx_blocks]
    context_mask: torch.Tensor  # [rows, ctx_blocks * block_size] bool
    draft_ids: torch.Tensor  # [rows, k] int64, padded with 0
    num_drafts: torch.Tensor  # [rows] int64


def _slots(block_table: Sequence[int], positions: range, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def _num_context_tokens(chunks: Sequence[PrefillChunk], block_size: int) -> int:
    """Cached tokens a prefill step reads: every chunk's cached blocks, whole."""
    return block_size * sum(blocks_needed(c.num_cached, block_size) for c in chunks)


def _prefill_buckets(
    chunks: Sequence[PrefillChunk], config: RuntimeConfig
) -> tuple[ProgramKey, int] | None:
    """(the prefill program, the head's row bucket) for these chunks; None if any is too big."""
    num_tokens = fitting_bucket(config.prefill_token_buckets, sum(len(c.token_ids) for c in chunks))
    num_ctx_tokens = fitting_bucket(
        config.prefill_context_buckets, _num_context_tokens(chunks, config.block_size)
    )
    num_rows = fitting_bucket(config.head_row_buckets, len(chunks))
    if num_tokens is None or num_ctx_tokens is None or num_rows is None:
        return None
    return ProgramKey(ProgramKind.PREFILL, num_tokens, num_ctx_tokens), num_rows


def prefill_key(chunks: Sequence[PrefillChunk], config: RuntimeConfig) -> ProgramKey | None:
    """The prefill program for these chunks packed in one step; None if no bucket fits them."""
    buckets = _prefill_buckets(chunks, config)
    return None if buckets is None else buckets[0]


# What a prefill program call costs beyond its bucket's tokens, counted in tokens: each
# quantised weight dequantised once a call, a GEMM of few rows below its peak
# (docs/benchmarks.md#prefill-call-cost).
PREFILL_CALL_TOKENS = 48


def prefill_pieces(
    chunks: Sequence[PrefillChunk], config: RuntimeConfig
) -> list[list[PrefillChunk]]:
    """A prefill step as program calls: one sequence's chunk that its bucket would pad more than
    the calls cost (`bucket_split`: 130 tokens as 128 + 2, not in a bucket of 512) runs as
    pieces, each reading the ones before it from the cache; anything else as one call."""
    if len(chunks) != 1:
        return [list(chunks)]
    (chunk,) = chunks
    sizes = bucket_split(len(chunk.token_ids), config.prefill_token_buckets, PREFILL_CALL_TOKENS)
    pieces, start = [], 0
    for size in sizes:
        embeds = chunk.embeds
        if embeds is not None:
            embeds = embeds[start : start + size] if start < len(embeds) else None
        part = chunk.token_ids[start : start + size]
        pieces.append([PrefillChunk(part, chunk.num_cached + start, chunk.block_table, embeds)])
        start += size
    return pieces


def _refuse_prefill(chunks: Sequence[PrefillChunk], config: RuntimeConfig) -> ValueError:
    return ValueError(
        f"{len(chunks)} chunks of {sum(len(c.token_ids) for c in chunks)} tokens reading "
        f"{_num_context_tokens(chunks, config.block_size)} cached tokens fit no prefill program "
        f"(largest: {max(config.head_row_buckets)} chunks, {max(config.prefill_token_buckets)} "
        f"tokens, {max(config.prefill_context_buckets)} cached tokens)"
    )


def prepare_prefill(chunks: Sequence[PrefillChunk], config: RuntimeConfig) -> PrefillInputs:
    """Padded inputs of `prefill_key`'s program; ValueError, naming the limits, if none fits."""
    buckets = _prefill_buckets(chunks, config)
    if buckets is None:
        raise _refuse_prefill(chunks, config)
    key, num_rows = buckets
    bs = config.block_size
    token_ids, positions, slots, q_seq = [], [], [], []
    ctx_blocks, key_seq, key_pos = [], [], []
    logits_indices = []
    for seq, chunk in enumerate(chunks):
        span = range(chunk.num_cached, chunk.num_cached + len(chunk.token_ids))
        assert len(span) > 0, "a prefill chunk has at least one token"
        token_ids += chunk.token_ids
        positions += span
        slots += _slots(chunk.block_table, span, bs)
        q_seq += [seq] * len(span)
        logits_indices.append(len(token_ids) - 1)
        num_cached_blocks = blocks_needed(chunk.num_cached, bs)
        ctx_blocks += chunk.block_table[:num_cached_blocks]
        for p in range(num_cached_blocks * bs):
            is_cached = p < chunk.num_cached
            key_seq.append(seq if is_cached else _PAD_KEY_SEQ)
            key_pos.append(p)
    num_pad = key.size - len(token_ids)
    token_ids += [0] * num_pad
    positions += [0] * num_pad
    slots += [DUMMY_BLOCK * bs] * num_pad
    q_seq += [_PAD_SEQ - j for j in range(num_pad)]
    num_ctx_pad = key.context_tokens // bs - len(ctx_blocks)
    ctx_blocks += [DUMMY_BLOCK] * num_ctx_pad
    key_seq += [_PAD_KEY_SEQ] * (num_ctx_pad * bs)
    key_pos += [0] * (num_ctx_pad * bs)
    logits_indices += [0] * (num_rows - len(chunks))
    positions_t = torch.tensor(positions)
    return PrefillInputs(
        key=key,
        num_rows=num_rows,
        token_ids=torch.tensor(token_ids),
        positions=positions_t,
        slot_mapping=torch.tensor(slots),
        context_block_ids=torch.tensor(ctx_blocks, dtype=torch.int64),
        attn_mask=_prefill_mask(torch.tensor(q_seq), positions_t, key_seq, key_pos),
        logits_indices=torch.tensor(logits_indices),
        given_embeds=_given_embeds(chunks),
    )


def _given_embeds(chunks: Sequence[PrefillChunk]) -> GivenEmbeds | None:
    """The packed step's rows that take given embeddings (`PrefillChunk.embeds`), if any."""
    rows, values, offset = [], [], 0
    for chunk in chunks:
        if chunk.embeds is not None:
            assert len(chunk.embeds) <= len(chunk.token_ids), "embeddings beyond the chunk"
            rows += range(offset, offset + len(chunk.embeds))
            values.append(chunk.embeds)
        offset += len(chunk.token_ids)
    if not values:
        return None
    return GivenEmbeds(torch.tensor(rows, dtype=torch.int64), torch.cat(values))


def _prefill_mask(q_seq: torch.Tensor, positions: torch.Tensor, key_seq, key_pos) -> torch.Tensor:
    """[tokens, cached keys + tokens] bool: a query sees its own sequence's keys up to itself."""
    all_key_seq = torch.cat([torch.tensor(key_seq, dtype=torch.int64), q_seq])
    all_key_pos = torch.cat([torch.tensor(key_pos, dtype=torch.int64), positions])
    return (all_key_seq[None, :] == q_seq[:, None]) & (all_key_pos[None, :] <= positions[:, None])


def decode_key(rows: Sequence[DecodeRow], config: RuntimeConfig) -> ProgramKey | None:
    """The decode program for these rows; None if no bucket fits them."""
    num_rows = fitting_bucket(config.decode_batch_buckets, len(rows))
    num_ctx_tokens = _context_bucket(rows, config)
    if num_rows is None or num_ctx_tokens is None:
        return None
    return ProgramKey(ProgramKind.DECODE, num_rows, num_ctx_tokens)


def _context_bucket(rows: Sequence[DecodeRow | VerifyRow], config: RuntimeConfig) -> int | None:
    """The smallest decode context bucket holding every row's cached blocks; None if none."""
    longest = max(r.position for r in rows)
    num_ctx_tokens = config.block_size * blocks_needed(longest, config.block_size)
    return fitting_bucket(config.decode_context_buckets, max(num_ctx_tokens, 1))


def prepare_decode(rows: Sequence[DecodeRow], config: RuntimeConfig) -> DecodeInputs:
    """Padded inputs of `decode_key`'s program; ValueError, naming the limits, if none fits."""
    key = decode_key(rows, config)
    if key is None:
        raise ValueError(
            f"{len(rows)} decode rows at positions up to {max(r.position for r in rows)} fit no "
            f"decode program (largest: {max(config.decode_batch_buckets)} rows, "
            f"{max(config.decode_context_buckets)} cached tokens)"
        )
    num_rows, num_ctx_tokens = key.size, key.context_tokens
    bs = config.block_size
    tables = np.full((num_rows, num_ctx_tokens // bs), DUMMY_BLOCK, dtype=np.int64)
    token_ids = np.zeros(num_rows, dtype=np.int64)
    positions = np.zeros(num_rows, dtype=np.int64)  # also each row's number of cached tokens
    slots = np.full(num_rows, DUMMY_BLOCK * bs, dtype=np.int64)
    for i, row in enumerate(rows):
        cached = row.block_table[: blocks_needed(row.position, bs)]
        tables[i, : len(cached)] = cached
        token_ids[i] = row.token_id
        positions[i] = row.position
        slots[i] = _slots(row.block_table, range(row.position, row.position + 1), bs)[0]
    context_mask = np.arange(num_ctx_tokens)[None, :] < positions[:, None]
    return DecodeInputs(key, *_tensors(token_ids, positions, slots, tables, context_mask))


def _tensors(*arrays: np.ndarray) -> list[torch.Tensor]:
    """The step's inputs as tensors sharing the arrays' memory. A decode step's inputs are
    built in numpy: each torch call releases the GIL, and in a server every release lets the
    engine's other threads in (docs/benchmarks.md#host-work-in-numpy)."""
    return [torch.from_numpy(a) for a in arrays]


def prepare_sampling(
    rows: Sequence[RowSampling], num_rows: int, vocab_size: int
) -> SamplingTensors:
    """Pad per-row sampling settings to the head bucket; padded rows are greedy and ignored."""
    pad = num_rows - len(rows)
    params = [r.params for r in rows]
    masks = np.full((num_rows, mask_words(vocab_size)), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        if row.vocab_mask is not None:
            masks[i] = row.vocab_mask.numpy()

    def padded(values: list, pad_value: float, dtype) -> torch.Tensor:
        return torch.from_numpy(np.array(values + [pad_value] * pad, dtype=dtype))

    return SamplingTensors(
        temperature=padded([p.temperature for p in params], 1.0, np.float32),
        top_k=padded([p.top_k for p in params], 1, np.int64),
        top_p=padded([p.top_p for p in params], 1.0, np.float32),
        min_p=padded([p.min_p for p in params], 0.0, np.float32),
        seeds=padded([r.seed % (1 << 63) for r in rows], 0, np.int64),
        positions=padded([r.position for r in rows], 0, np.int64),
        vocab_mask=torch.from_numpy(masks),
    )


def verify_key(rows: Sequence[VerifyRow], config: RuntimeConfig) -> ProgramKey | None:
    """The verify program for these rows; None if no bucket fits them (or none exists)."""
    k = config.num_speculative_tokens
    if not k or any(len(r.token_ids) > k + 1 for r in rows):
        return None
    num_rows = fitting_bucket(config.verify_batch_buckets, len(rows))
    num_ctx_tokens = _context_bucket(rows, config)
    if num_rows is None or num_ctx_tokens is None:
        return None
    return ProgramKey(ProgramKind.VERIFY, num_rows, num_ctx_tokens, k)


def prepare_verify(rows: Sequence[VerifyRow], config: RuntimeConfig) -> VerifyInputs:
    """Padded inputs of `verify_key`'s program: every row padded to k + 1 tokens (rows with
    fewer drafts, none included, share the program); ValueError if none fits."""
    key = verify_key(rows, config)
    if key is None:
        raise ValueError(
            f"{len(rows)} verify rows of up to {max(len(r.token_ids) for r in rows)} tokens at "
            f"positions up to {max(r.position for r in rows)} fit no verify program (batches "
            f"{config.verify_batch_buckets}, {config.num_speculative_tokens} drafts, "
            f"{max(config.decode_context_buckets)} cached tokens)"
        )
    bs, n, k = config.block_size, key.num_positions, key.num_drafts
    num_ctx_blocks = key.context_tokens // bs
    tables = torch.full((key.size, num_ctx_blocks), DUMMY_BLOCK, dtype=torch.int64)
    lengths = torch.zeros(key.size, dtype=torch.int64)
    token_ids = torch.zeros(key.size, n, dtype=torch.int64)
    positions = torch.zeros(key.size, n, dtype=torch.int64)
    slots = torch.full((key.size, n), DUMMY_BLOCK * bs, dtype=torch.int64)
    num_drafts = torch.zeros(key.size, dtype=torch.int64)
    for i, row in enumerate(rows):
        cached = row.block_table[: blocks_needed(row.position, bs)]
        tables[i, : len(cached)] = torch.tensor(cached, dtype=torch.int64)
        lengths[i] = row.position
        m = len(row.token_ids)
        token_ids[i, :m] = torch.tensor(row.token_ids, dtype=torch.int64)
        positions[i] = torch.arange(row.position, row.position + n)
        span = range(row.position, row.position + m)
        slots[i, :m] = torch.tensor(_slots(row.block_table, span, bs), dtype=torch.int64)
        num_drafts[i] = m - 1
    context_mask = torch.arange(key.context_tokens)[None, :] < lengths[:, None]
    return VerifyInputs(
        key=key,
        token_ids=token_ids.view(-1),
        positions=positions.view(-1),
        slot_mapping=slots.view(-1),
        block_tables=tables,
        context_mask=context_mask,
        draft_ids=token_ids[:, 1:].clone() if k else token_ids[:, :0],
        num_drafts=num_drafts,
    )
