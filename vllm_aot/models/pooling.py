"""Sequence pooling of an embedding model: which token states make a sentence's embedding, as
sentence-transformers' directory states it (`1_Pooling/config.json`, a `Normalize` module in
`modules.json`) and as vLLM names the kinds (`CLS`, `MEAN`, `LAST`).

`pool` is the maths: the first token's state, the mean of every token's, or the last one's, in
float32, then an L2 normalisation when asked.
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


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One sequence's token states [tokens, hidden] -> its embedding [hidden] float32."""
    states = hidden.float()
    if pooling.type == "CLS":
        out = states[0]
    elif pooling.type == "MEAN":
        out = states.mean(0)
    else:
        out = states[-1]
    return F.normalize(out, dim=-1) if pooling.normalize else out


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
