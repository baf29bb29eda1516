"""Sequence pooling of an embedding model: which token states make a sentence's embedding, as
sentence-transformers' directory states it (`1_Pooling/config.json`, a `Normalize` module in
`modules.json`) and as vLLM names the kinds (`CLS`, `MEAN`, `LAST`).

`pool` is the maths: the first token's state, the mean of every token's, or the last one's, in
float32, then an L2 normalisation when asked; `PooledChunks` the same over a prompt that arrives
in chunks (a decoder's chunked prefill).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True)
class Pooling:
    type: str  # one of POOLING_TYPES
    normalize: bool

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ValueError(
                f"pooling {self.type!r} is not supported; supported: {', '.join(POOLING_TYPES)}"
            )


@dataclass
class PooledChunks:
    """One sequence's pooling while its token states arrive chunk by chunk, in order: what
    `result` gives is `pool` of all of them at once."""

    pooling: Pooling
    first: torch.Tensor | None = None  # [hidden] float32
    last: torch.Tensor | None = None
    total: torch.Tensor | None = None  # sum of every state so far (MEAN)
    num_tokens: int = 0

    def add(self, states: torch.Tensor) -> None:
        """The next chunk's states [tokens, hidden] (model dtype)."""
        states = states.float()
        if self.first is None:
            self.first = states[0]
        self.last = states[-1]
        if self.pooling.type == "MEAN":
            chunk_sum = states.sum(0)
            self.total = chunk_sum if self.total is None else self.total + chunk_sum
        self.num_tokens += states.shape[0]

    def result(self) -> torch.Tensor:
        """The embedding [hidden] float32, L2-normalised when the pooling asks."""
        assert self.num_tokens, "no token states pooled"
        if self.pooling.type == "CLS":
            out = self.first
        elif self.pooling.type == "MEAN":
            out = self.total / self.num_tokens
        else:
            out = self.last
        return F.normalize(out, dim=-1) if self.pooling.normalize else out


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One sequence's token states [tokens, hidden] -> its embedding [hidden] float32."""
    pooled = PooledChunks(pooling)
    pooled.add(hidden)
    return pooled.result()


def declared_max_len(model_dir: str | Path) -> int | None:
    """The longest sequence a sentence-transformers directory declares (`max_seq_length` of its
    `sentence_bert_config.json`), which vLLM takes as the model's length limit; None if none."""
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return int(value) if value is not None else None


def read_pooling(model_dir: str | Path) -> Pooling | None:
    """The pooling a sentence-transformers directory declares; None for a plain HF one.
    Raises ValueError for a pooling mode we do not implement (max, mean over sqrt(length))."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    pooling_dir = next((m["path"] for m in modules if m["type"].endswith(".Pooling")), "1_Pooling")
    config = json.loads((model_dir / pooling_dir / "config.json").read_text())
    modes = [k for k, on in config.items() if k.startswith("pooling_mode_") and on]
    by_mode = {
        "pooling_mode_cls_token": "CLS",
        "pooling_mode_mean_tokens": "MEAN",
        "pooling_mode_lasttoken": "LAST",
    }
    if len(modes) != 1 or modes[0] not in by_mode:
        raise ValueError(
            f"{model_dir}: pooling modes {modes} are not supported; supported: one of "
            f"{', '.join(by_mode)}"
        )
    normalize = any(m["type"].endswith(".Normalize") for m in modules)
    return Pooling(by_mode[modes[0]], normalize)
