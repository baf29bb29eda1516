"""A model as the user names it: an HF directory (config.json beside its weights, or beside one
`*.gguf`), or a `.gguf` file of its own (`gguf_config.py`: its config from its metadata, its
tokenizer converted from them, its weights read under quantization "gguf", which it implies).

Every start-up reads a model's architecture here (`load_arch`), whichever form it takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_aot.models.config import ModelArch, load_hf_config
from vllm_aot.models.gguf import GgufFile
from vllm_aot.models.gguf_config import companion_dir, hf_config, is_gguf_file
from vllm_aot.models.registry import arch_from_hf_config


def model_hf_config(source: str | Path) -> dict[str, Any]:
    """The HF config dictionary of `source`: its config.json, or a `.gguf`'s metadata."""
    if is_gguf_file(source):
        return hf_config(GgufFile(source))
    return load_hf_config(source)


def load_arch(source: str | Path) -> ModelArch:
    """`source`'s architecture; ValueError naming the supported ones."""
    return arch_from_hf_config(model_hf_config(source))


def implied_quantization(source: str | Path, quantization: str | None) -> str | None:
    """The quantization `source` is served under: "gguf" for a `.gguf` file (its blocks are its
    weights), `quantization` otherwise; ValueError for a `.gguf` asked another."""
    if not is_gguf_file(source):
        return quantization
    if quantization not in (None, "gguf"):
        raise ValueError(
            f"{Path(source).name} is a GGUF file: it serves quantization gguf (its own blocks), "
            f"not {quantization}"
        )
    return "gguf"


def transformers_source(source: str | Path) -> tuple[Path, dict[str, Any]]:
    """(directory, keyword arguments) transformers' `from_pretrained` loads `source` from: the
    directory itself, or a `.gguf`'s companion directory with `gguf_file` (its weights
    dequantised by transformers)."""
    if not is_gguf_file(source):
        return Path(source), {}
    return companion_dir(source), {"gguf_file": Path(source).resolve().name}


def tokenizer_dir(source: str | Path) -> Path:
    """Where `source`'s tokenizer (and config.json) is read: the directory itself, or a `.gguf`'s
    companion directory (its tokenizer converted from the file's metadata once)."""
    return companion_dir(source) if is_gguf_file(source) else Path(source)
