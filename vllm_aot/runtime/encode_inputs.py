"""An encoder's step inputs (runner "pooling"): whole sequences packed into the windows of an
encode program, the program chosen here (`encode_layout`) and carried as `inputs.key`.

A step's sequences are packed longest first into windows of the program's width, none across a
window's edge, and attend only within their own sequence (the mask); padding tokens are token 0
at position 0 and see only themselves. `encode_steps` groups a request batch's sequences into
steps: each sequence with others of its window, so sentences never attend over a passage's
window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, ProgramKind


@dataclass(frozen=True)
class EncoderSequence:
    """One whole sequence for an encoder step (runner "pooling")."""

    token_ids: Sequence[int]
    token_type_ids: Sequence[int] | None = None  # None: all 0


class EncodeInputs(NamedTuple):
    key: ProgramKey  # encode_t{tokens}_w{window}
    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens], each token's position in its sequence
    token_type_ids: torch.Tensor  # [tokens]
    attn_mask: torch.Tensor  # [windows, window, window] bool: within a sequence; padding: itself
    starts: tuple[int, ...]  # each sequence's first token (then its len(token_ids))


def _pack(lengths: Sequence[int], window: int, num_windows: int) -> list[int] | None:
    """Each sequence's first token when sequences of `lengths` are packed into `num_windows`
    windows of `window` tokens, none across an edge: first fit, longest first. None when they
    do not fit."""
    free = [window] * num_windows
    starts = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        slot = next((j for j, room in enumerate(free) if room >= n), None)
        if slot is None:
            return None
        starts[i] = (slot + 1) * window - free[slot]
        free[slot] -= n
    return starts


def encode_layout(
    lengths: Sequence[int], config: RuntimeConfig, max_window: int | None = None
) -> tuple[ProgramKey, list[int]] | None:
    """The encode program for sequences of `lengths` (the smallest token bucket they pack into,
    then its narrowest window that does; none wider than `max_window` when given), and each
    sequence's first token; None when none holds them."""
    total, longest = sum(lengths), max(lengths, default=0)
    for size in sorted(config.prefill_token_buckets):
        if size < total:
            continue
        for window in sorted(config.encode_windows(size)):
            if window < longest or (max_window is not None and window > max_window):
                continue
            starts = _pack(lengths, window, size // window)
            if starts is not None:
                return ProgramKey(ProgramKind.ENCODE, size, window=window), starts
    return None


def encode_steps(lengths: Sequence[int], config: RuntimeConfig) -> list[list[int]]:
    """Sequences of `lengths` (their indices) grouped into encode steps: longest first, each
    into the first step it still fits (`encode_layout`) among those of its window (the
    narrowest holding it), so sentences never attend over a passage's window. Every length
    must fit a bucket alone."""
    widest = config.encode_windows(max(config.prefill_token_buckets))
    steps: list[tuple[int | None, list[int], list[int]]] = []  # window, indices, lengths
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        window = min((w for w in widest if w >= n), default=None)
        for step_window, indices, step in steps:
            if step_window == window and encode_layout([*step, n], config, window) is not None:
                indices.append(i)
                step.append(n)
                break
        else:
            steps.append((window, [i], [n]))
    return [indices for _, indices, _ in steps]


def prepare_encode(sequences: Sequence[EncoderSequence], config: RuntimeConfig) -> EncodeInputs:
    """Sequences packed into the encode program `encode_layout` picks, none across an attention
    window's edge, padded with token 0 at position 0. Raises ValueError naming the largest
    bucket when they do not fit."""
    layout = encode_layout([len(s.token_ids) for s in sequences], config)
    if layout is None:
        raise ValueError(
            f"{sum(len(s.token_ids) for s in sequences)} tokens of {len(sequences)} sequences do "
            f"not fit the largest encode bucket ({max(config.prefill_token_buckets)} tokens, "
            "max_num_batched_tokens)"
        )
    key, starts = layout
    size = key.size
    token_ids = torch.zeros(size, dtype=torch.int64)
    positions = torch.zeros(size, dtype=torch.int64)
    token_types = torch.zeros(size, dtype=torch.int64)
    seq_ids = torch.arange(size, dtype=torch.int64) + len(sequences)  # padding: its own
    for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
        end = start + len(seq.token_ids)
        token_ids[start:end] = torch.as_tensor(seq.token_ids, dtype=torch.int64)
        positions[start:end] = torch.arange(end - start)
        if seq.token_type_ids is not None:
            token_types[start:end] = torch.as_tensor(seq.token_type_ids, dtype=torch.int64)
        seq_ids[start:end] = i
    seq_ids = seq_ids.view(size // key.window, key.window)
    mask = seq_ids[:, :, None] == seq_ids[:, None, :]
    return EncodeInputs(key, token_ids, positions, token_types, mask, tuple(starts))
