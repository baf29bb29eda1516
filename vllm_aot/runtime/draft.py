"""Drafts from a draft model for speculative decoding: one token a pass, on compiled programs.

Each row's newest token (sampled, not yet in the target's cache) goes through the draft model's
layers, its head picks the first draft, that draft goes in at the next position, and so on for
up to k passes (a row stops at its own `num_drafts`, so rows near their end or max_model_len
take fewer). A pass is a decode program at the rows' batch bucket and a greedy head program.
Greedy drafts are point masses, which the verify step's rejection sampling takes at any
temperature (`runtime/verify.py`).

The draft model has its own weights, programs and pool, addressed by the target's block ids. It
holds the K/V of the tokens it was fed (`_fed`), and before drafting takes in whatever of the
request it has not seen, or saw with another value (a rejected draft), through its prefill
programs: the prompt the first time, then the one or two tokens a verify step accepted past
what it fed. A request's draft state is dropped with `forget` (finished, preempted).

The caller reserves the blocks the passes write: positions up to len(tokens) - 1 + num_drafts - 1
(vLLM's lookahead slots for a draft model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.sampler import GREEDY


@dataclass(frozen=True)
class DraftRow:
    """A request to draft for: every token so far (the last one the newest, not in the target's
    cache), its block table (covering the positions the passes write) and how many drafts."""

    req_id: str
    tokens: Sequence[int]
    block_table: Sequence[int]
    num_drafts: int


class ModelDraft:
    """Greedy drafts from a draft model of its own (every layer, its own pool)."""

    def __init__(self, model: CompiledModel) -> None:
        self.model = model
        self._fed: dict[str, list[int]] = {}  # the tokens whose K/V it holds, in order

    def forget(self, req_id: str) -> None:
        """Drop a request's draft state (finished, or resumed with fresh blocks)."""
        self._fed.pop(req_id, None)

    def propose(self, rows: Sequence[DraftRow]) -> dict[str, list[int]]:
        """req_id -> the row's drafts, `num_drafts` of them (rows asking none left out)."""
        rows = [r for r in rows if r.num_drafts > 0]
        drafts: dict[str, list[int]] = {}
        if not rows:
            return drafts
        for row, token in zip(rows, self._first_drafts(rows), strict=True):
            drafts[row.req_id] = [token]
        for step in range(1, max(r.num_drafts for r in rows)):
            live = [r for r in rows if r.num_drafts > step]
            tokens = self._pass(
                [
                    DecodeRow(drafts[r.req_id][-1], len(r.tokens) - 1 + step, r.block_table)
                    for r in live
                ],
            )
            for row, token in zip(live, tokens, strict=True):
                drafts[row.req_id].append(token)
        for row in rows:  # fed: every token, then every draft but the last
            self._fed[row.req_id] = [*row.tokens, *drafts[row.req_id][:-1]]
        return drafts

    def _first_drafts(self, rows: Sequence[DraftRow]) -> list[int]:
        """The first draft of each row: a decode pass over the rows whose only unseen token is
        the newest, prefill chunks for the others (catching up)."""
        first: dict[str, int] = {}
        seen = {r.req_id: self._num_seen(r) for r in rows}
        single = [r for r in rows if seen[r.req_id] == len(r.tokens) - 1]
        if single:
            newest = [DecodeRow(r.tokens[-1], len(r.tokens) - 1, r.block_table) for r in single]
            for row, token in zip(single, self._pass(newest), strict=True):
                first[row.req_id] = token
        for row in rows:
            if row.req_id not in first:
                first[row.req_id] = self._catch_up(row, seen[row.req_id])
        return [first[r.req_id] for r in rows]

    def _num_seen(self, row: DraftRow) -> int:
        """How many leading tokens of the row the draft holds K/V for (never the newest)."""
        fed, tokens = self._fed.get(row.req_id, ()), row.tokens
        n = 0
        limit = min(len(fed), len(tokens) - 1)
        while n < limit and fed[n] == tokens[n]:
            n += 1
        return n

    def _pass(self, inputs: Sequence[DecodeRow]) -> list[int]:
        """One decode pass through the draft's layers and its head: a greedy token per row."""
        hidden = self.model.forward_decode(inputs)
        sampling = [RowSampling(GREEDY, 0, i.position + 1) for i in inputs]
        return self.model.sample(hidden, sampling).tokens.tolist()

    def _catch_up(self, row: DraftRow, start: int) -> int:
        """Feed tokens[start:] through the draft's prefill programs, in chunks of its largest
        prefill bucket; the first draft from the last chunk's last token."""
        largest = max(self.model.config.prefill_token_buckets)
        hidden: torch.Tensor | None = None
        end = len(row.tokens)
        for begin in range(start, end, largest):
            piece = row.tokens[begin : min(begin + largest, end)]
            chunk = PrefillChunk(piece, begin, row.block_table)
            hidden = self.model.forward_prefill([chunk]).last
        assert hidden is not None
        sampled = self.model.sample(hidden, [RowSampling(GREEDY, 0, end)])
        return int(sampled.tokens[0])


@dataclass
class _GateState:
    history: list[int]  # accepted drafts of each verify step since the last decision
    pause: int = 0  # the last pause's length (0: none yet)
    left: int = 0  # steps still paused
    last: tuple[int, tuple[int, ...]] | None = None  # (tokens when drafted, the drafts)


class DraftGate:
    """Which requests draft this step: a request whose drafts keep failing stops drafting.

    After each `window` verify steps a request drafted in, if they accepted fewer than
    `min_accepted` drafts a step on average, it drafts nothing for a pause (`first_pause` steps,
    doubling each time it fails again, at most `max_pause`), then tries again. Drafts that fail
    cost their passes and a verify step each time (several decode steps), so text a drafter
    cannot guess (prompt lookup on new prose, a draft model unlike the target there) soon
    decodes at plain speed. How many were accepted is read from the request's tokens: the
    drafts that reappear in order after the position they were drafted for (a verify step's
    correction is never the draft it replaces).

    With `is_shared` (a draft model: whether it agrees with the target is mostly a property of
    the pair, not of one request's text), a new request starts where the last decision left
    off: paused as long as the last failing request was, open after one whose drafts paid."""

    def __init__(
        self,
        window: int = 4,
        min_accepted: float = 0.5,
        first_pause: int = 16,
        max_pause: int = 256,
        *,
        is_shared: bool = False,
    ) -> None:
        self.window = window
        self.min_accepted = min_accepted
        self.first_pause = first_pause
        self.max_pause = max_pause
        self.is_shared = is_shared
        self._last_pause = 0  # the last decision's pause (0: drafts paid)
        self._states: dict[str, _GateState] = {}

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def allows(self, req_id: str, tokens: Sequence[int]) -> bool:
        """Whether the request, whose tokens are now `tokens`, drafts this step (its last
        drafts' outcome recorded first)."""
        state = self._states.get(req_id)
        if state is None:
            pause = self._last_pause if self.is_shared else 0
            state = self._states[req_id] = _GateState([], pause=pause, left=pause)
        if state.last is not None:
            start, drafts = state.last
            state.last = None
            accepted = 0
            while accepted < len(drafts) and start + accepted < len(tokens):
                if tokens[start + accepted] != drafts[accepted]:
                    break
                accepted += 1
            self._record(state, accepted)
        if state.left > 0:
            state.left -= 1
            return False
        return True

    def drafted(self, req_id: str, num_tokens: int, drafts: Sequence[int]) -> None:
        """The request drafted `drafts` for the positions from `num_tokens` on."""
        if drafts:
            self._states.setdefault(req_id, _GateState([])).last = (num_tokens, tuple(drafts))

    def _record(self, state: _GateState, accepted: int) -> None:
        state.history.append(accepted)
        if len(state.history) < self.window:
            return
        if sum(state.history) < self.min_accepted * len(state.history):
            state.pause = min(self.max_pause, 2 * state.pause or self.first_pause)
            state.left = state.pause
        else:
            state.pause = 0
        state.history.clear()
        self._last_pause = state.pause
