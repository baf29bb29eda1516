"""One sampling pipeline: the tail of every head program and of host-side re-sampling.

`sample_rows` runs vLLM v1's order in one pass over raw logits [rows, vocab] float32: raw
logprobs (vLLM's default `raw_logprobs`: the model's distribution before any processing), then
the vocabulary mask over the logits to sample from (the raw ones, or a host-processed copy), then
greedy argmax or temperature, min-p, top-k, top-p and a seeded exponential race, then the sampled
token's logprob and 1-based rank and the top-n logprobs. It is static-shape tensor code, so inside
the compiled head program greedy decoding never copies logits out and sampling costs no Python per
row. Two head variants exist: greedy (a step whose rows are all greedy, `all_greedy`) and sampling.

Greedy is defined once, by `SamplingParams.is_greedy`; normalised greedy parameters (`GREEDY`)
are top_k 1, which is how a sampling head tells greedy rows apart.

Top-k and top-p are decided among the `num_candidates` most likely tokens (a full vocabulary sort
is slow on a CPU: docs/benchmarks.md#head-kernels); a nucleus wider than that is cut at the
candidates. Min-p and
plain temperature sampling are exact over the whole vocabulary.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Annotated, NamedTuple

import torch

from vllm_aot.runtime.signature import Arg

# (logits [rows, vocab], tokens [rows], n) -> (token logprobs, ranks, top-n logprobs, top-n ids)
LogprobStats = Callable[
    [torch.Tensor, torch.Tensor, int],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
]
# (logits to draw from [rows, vocab], SamplingTensors, is_greedy, num_candidates) -> tokens [rows]
DrawTokens = Callable[[torch.Tensor, "SamplingTensors", bool, int], torch.Tensor]

_U32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27, so a 32-bit value times it never overflows int64
_SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's threshold)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; greedy when `is_greedy`."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_logprobs: int | None = None  # top-n logprobs to return besides the sampled token's

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        """The one definition of greedy: (near-)zero temperature, or top_k 1."""
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    def normalized(self) -> SamplingParams:
        """A copy the compiled sampler understands: greedy becomes top_k=1 at temperature 1."""
        if self.is_greedy:
            return replace(self, temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
        return replace(self, top_k=max(self.top_k, 0))


GREEDY = SamplingParams(temperature=0.0).normalized()  # greedy, as the head programs read it


def all_greedy(params: Iterable[SamplingParams]) -> bool:
    """Whether a head run may use the greedy variant: every row is greedy."""
    return all(p.is_greedy for p in params)


def draw_seed(name: str | None = None) -> int:
    """A seed for a request that brought none, so every row samples from its own stream: drawn
    at random, or derived from the request's unique `name` (every tensor-parallel rank then
    draws the same seed for it, and samples the same tokens)."""
    if name is None:
        return random.getrandbits(63)
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1


_F32, _I64 = torch.float32, torch.int64


class SamplingTensors(NamedTuple):
    """Per-row sampling inputs of a head program (`rows` = the head bucket; `signature.py`)."""

    temperature: Annotated[torch.Tensor, Arg(("rows",), _F32, fill=1)]  # > 0
    top_k: Annotated[torch.Tensor, Arg(("rows",), _I64)]  # 0 = off, 1 = greedy
    top_p: Annotated[torch.Tensor, Arg(("rows",), _F32, fill=1)]
    min_p: Annotated[torch.Tensor, Arg(("rows",), _F32)]
    seeds: Annotated[torch.Tensor, Arg(("rows",), _I64)]
    # the position of the token being sampled (the RNG counter)
    positions: Annotated[torch.Tensor, Arg(("rows",), _I64)]
    # [rows, ceil(vocab / 32)] bitmask, bit set = allowed
    vocab_mask: Annotated[torch.Tensor, Arg(("rows", "mask_words"), torch.int32, fill=-1)]


class SamplerOutput(NamedTuple):
    """What a head program returns; every field describes the raw logits except `tokens`."""

    tokens: torch.Tensor  # [rows] int64
    token_logprobs: torch.Tensor  # [rows] float32, raw log-softmax of the sampled token
    token_ranks: torch.Tensor  # [rows] int64, 1-based: tokens whose logprob >= the sampled one's
    top_logprobs: torch.Tensor  # [rows, num_logprobs] float32
    top_ids: torch.Tensor  # [rows, num_logprobs] int64
    logits: torch.Tensor  # [rows, vocab] float32, raw; read only for host processing, validation


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def token_mask(token_id: int, vocab_size: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32 bitmask allowing `token_id` alone."""
    assert 0 <= token_id < vocab_size, f"token {token_id} outside the vocabulary ({vocab_size})"
    words = torch.zeros(mask_words(vocab_size), dtype=torch.int64)
    words[token_id // 32] = 1 << (token_id % 32)
    return words.to(torch.int32)  # bit 31 wraps to the sign bit, as the bitmask means it


def unpack_vocab_mask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab] bool."""
    vocab = torch.arange(vocab_size, device=words.device)
    bits = words[:, vocab // 32] >> (vocab % 32).to(torch.int32)
    return (bits & 1).bool()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MIX) & _U32
    x = (((x >> 16) ^ x) * _MIX) & _U32
    return (x >> 16) ^ x


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1), a pure function of (seed, position, token id).

    Counter-based, so a seeded request draws the same numbers whatever batch or bucket it runs in,
    eagerly or compiled.
    """
    seed_hash = _mix32(seeds & _U32) ^ _mix32(((seeds >> 32) & _U32) ^ 0x9E3779B9)
    row = _mix32(seed_hash ^ _mix32(positions & _U32))
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(row[:, None] ^ vocab[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_rows(
    logits: torch.Tensor,
    t: SamplingTensors,
    *,
    is_greedy: bool,
    num_logprobs: int,
    num_candidates: int,
    processed: torch.Tensor | None = None,
    stats: LogprobStats | None = None,
    draw: DrawTokens | None = None,
) -> SamplerOutput:
    """One token per row of raw `logits` [rows, vocab] float32, with vLLM's raw logprobs.

    Tokens are drawn from `processed` [rows, vocab] when given (host-side penalties, bias, bans),
    else from `logits` (`draw`: `draw_tokens` or a kernel computing the same); the logprobs,
    ranks and top-n always describe `logits`, before any processing or mask (`stats`:
    `logprob_stats` or a kernel computing the same).
    """
    source = logits if processed is None else processed
    tokens = (draw or draw_tokens)(source, t, is_greedy, min(num_candidates, logits.shape[-1]))
    token_logprobs, ranks, top_logprobs, top_ids = (stats or logprob_stats)(
        logits, tokens, num_logprobs
    )
    return SamplerOutput(tokens, token_logprobs, ranks, top_logprobs, top_ids, logits)


def draw_tokens(
    source: torch.Tensor, t: SamplingTensors, is_greedy: bool, num_candidates: int
) -> torch.Tensor:
    """One token per row of `source` [rows, vocab] float32 within each row's vocabulary mask:
    the argmax for greedy rows (top_k 1, or every row when `is_greedy`, which leaves out the
    random path), else temperature, min-p, top-k and top-p (decided among `num_candidates`),
    then the seeded exponential race. The reference for the kernel `vllm_aot::sample_tokens`,
    which head programs call where kernels build."""
    allowed = unpack_vocab_mask(t.vocab_mask, source.shape[-1])
    masked = source.masked_fill(~allowed, float("-inf"))
    tokens = masked.argmax(dim=-1)
    if is_greedy:
        return tokens
    drawn = _random_tokens(masked, allowed, t, num_candidates)
    return torch.where(t.top_k == 1, tokens, drawn)  # normalised greedy rows: top_k 1


def logprob_stats(
    logits: torch.Tensor, tokens: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's raw logprobs of `logits` [rows, vocab] float32 for `tokens` [rows]: the tokens'
    logprobs [rows], their 1-based ranks [rows] (how many logprobs are at least the token's, as
    vLLM counts) and the top-n logprobs and ids [rows, n]. The reference for the kernel
    `vllm_aot::logprob_stats`, which head programs call where kernels build."""
    logprobs = torch.log_softmax(logits, dim=-1)
    token_logprobs = logprobs.gather(1, tokens[:, None])  # [rows, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(n, dim=-1)
    return token_logprobs[:, 0], ranks, top_logprobs, top_ids


def _random_tokens(
    masked: torch.Tensor, allowed: torch.Tensor, t: SamplingTensors, num_candidates: int
) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p, then a seeded exponential race; tokens [rows].

    masked: [rows, vocab] logits with disallowed tokens at -inf; allowed: [rows, vocab] bool.
    """
    probs, keep = target_probs(masked, allowed, t, num_candidates)
    uniforms = seeded_uniform(t.seeds, t.positions, masked.shape[-1])
    return race(probs, keep, uniforms)


def target_probs(
    masked: torch.Tensor, allowed: torch.Tensor, t: SamplingTensors, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sampled row draws from: (probs [rows, vocab] after temperature, keep [rows, vocab]
    bool after min-p, top-k, top-p and the mask); the distribution is probs over keep,
    renormalised."""
    probs = torch.softmax(masked / t.temperature[:, None], dim=-1)  # [rows, vocab]
    cand_probs, _ = probs.topk(num_candidates, dim=-1)  # [rows, cand], descending
    rank = torch.arange(num_candidates, device=masked.device)
    top_k = torch.where(t.top_k > 0, t.top_k, num_candidates).clamp(max=num_candidates)
    mass_before = cand_probs.cumsum(dim=-1) - cand_probs
    kept = (rank[None, :] < top_k[:, None]) & (mass_before < t.top_p[:, None])
    num_kept = kept.sum(dim=-1).clamp(min=1)
    threshold = cand_probs.gather(1, (num_kept - 1)[:, None])  # [rows, 1]
    is_truncated = ((t.top_k > 0) | (t.top_p < 1.0))[:, None]
    threshold = torch.where(is_truncated, threshold, 0.0)
    threshold = torch.maximum(threshold, t.min_p[:, None] * cand_probs[:, :1])
    return probs, (probs >= threshold) & allowed


def race(probs: torch.Tensor, keep: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax of probs / -log(u) over `keep`, a draw from probs over keep
    renormalised (tokens [rows]); `uniforms` [rows, vocab] from `seeded_uniform`."""
    return torch.where(keep, probs / -torch.log(uniforms), -1.0).argmax(dim=-1)
