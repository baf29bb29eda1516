"""Where a model's tensors come from: a safetensors directory (float tensors, prepared in each
linear's weight format at load) or a GGUF file (tensors stored in their formats, used as they
are).

`open_checkpoint(model_dir, quantization)` opens the one a quantization reads: "gguf" a `.gguf`
given as the model, or the one `*.gguf` of the directory (`gguf.find_gguf`), anything else its
safetensors. Both give tensors by
HF name: `dense(name)` a float tensor (norms, biases) as stored; `stored(linear, names, rank)` a
linear's weight as `linear.format` stores it, its parts (`names`) fused along the output and
`rank`'s shard taken. A GGUF serves a quantised format only from tensors stored in it, and a
dense format only from dense tensors; anything else is refused.

`resolve_weight_formats` is what every start-up asks (`loading/startup.py`, the plugin): the
`RuntimeConfig.weight_formats` a directory serves under a quantization.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from vllm_aot.models.config import ModelArch
from vllm_aot.models.formats import weight_format
from vllm_aot.models.gguf import GgufFile, find_gguf, gguf_weight_formats
from vllm_aot.models.linear import CheckpointFormats, Linear, Rank, shard_stored, shard_weight
from vllm_aot.models.source import load_arch


class Checkpoint(Protocol):
    """A model's tensors by HF name; a missing one is a KeyError naming it."""

    def has(self, name: str) -> bool: ...

    def dense(self, name: str) -> torch.Tensor:
        """A float tensor as stored (a norm's or a bias)."""
        ...

    def stored(self, linear: Linear, names: Sequence[str], rank: Rank) -> tuple[torch.Tensor, ...]:
        """`linear`'s weight in its format's stored tensors: the HF tensors `names` fused along
        the output (`linear.sources` in order), `rank`'s shard."""
        ...


def _prepared(
    linear: Linear, parts: Sequence[torch.Tensor], rank: Rank
) -> tuple[torch.Tensor, ...]:
    """Float parts [out_i, in] fused, sharded and prepared in the linear's format."""
    weight = parts[0] if len(parts) == 1 else torch.cat(list(parts))
    return weight_format(linear.format).prepare(shard_weight(linear, weight, rank))


def _is_dense(format_name: str) -> bool:
    return weight_format(format_name).tensor_names == ("weight",)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: quantization 'gguf' reads it)" if ggufs else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


class SafetensorsCheckpoint:
    """The float tensors of an HF directory, read once."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, torch.Tensor] = {}
        for path in _safetensors_files(self.model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self.tensors[name] = f.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def dense(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} missing from {self.model_dir}")
        return self.tensors[name]

    def stored(self, linear: Linear, names: Sequence[str], rank: Rank) -> tuple[torch.Tensor, ...]:
        return _prepared(linear, [self.dense(name) for name in names], rank)


class GgufCheckpoint:
    """The tensors of a `.gguf` as it stores them (`models/gguf.py`)."""

    def __init__(self, path: str | Path, arch: ModelArch) -> None:
        self.file = GgufFile(path)
        self.file.check_family(arch)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def dense(self, name: str) -> torch.Tensor:
        weight = self.file.weight(name)
        if weight.format is not None:
            raise ValueError(f"{self.file.path.name}: {name} is {weight.type.name}, not a float")
        return weight.tensors[0]

    def stored(self, linear: Linear, names: Sequence[str], rank: Rank) -> tuple[torch.Tensor, ...]:
        parts = [self.file.weight(name) for name in names]
        if _is_dense(linear.format) and all(p.format is None for p in parts):
            return _prepared(linear, [p.tensors[0] for p in parts], rank)
        if any(p.format != linear.format for p in parts):
            types = ", ".join(sorted({p.type.name for p in parts}))
            raise ValueError(
                f"{self.file.path.name} stores {', '.join(names)} as {types}, but the "
                f"configuration asks {linear.name} in {linear.format}; the file serves "
                "the weight formats `resolve_weight_formats` gives"
            )
        planes = zip(*(p.tensors for p in parts), strict=True)
        fused = tuple(plane[0] if len(plane) == 1 else torch.cat(plane) for plane in planes)
        return shard_stored(linear, fused, rank)


def open_checkpoint(model_dir: str | Path, quantization: str | None, arch: ModelArch) -> Checkpoint:
    """The checkpoint of `arch` (read from `model_dir`'s config.json) `quantization` reads."""
    if quantization == "gguf":
        return GgufCheckpoint(find_gguf(model_dir), arch)
    return SafetensorsCheckpoint(model_dir)


def resolve_weight_formats(
    model_dir: str | Path, quantization: str | None, dtype: torch.dtype
) -> CheckpointFormats:
    """The `RuntimeConfig.weight_formats` and `layer_groups` `model_dir` serves under
    `quantization` with programs of `dtype`: a GGUF's from its tensor types
    (`gguf.gguf_weight_formats`, refusing what it cannot serve); none otherwise (dense, or every
    linear in int8: the configuration's default)."""
    if quantization != "gguf":
        return CheckpointFormats()
    return gguf_weight_formats(find_gguf(model_dir), load_arch(model_dir), dtype)
