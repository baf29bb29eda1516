"""GGUF files (placeholder until the reader lands): each linear's format for a quantization."""

from __future__ import annotations

from pathlib import Path


def resolve_weight_formats(
    model_dir: str | Path, quantization: str | None
) -> tuple[tuple[str, str], ...]:
    """`RuntimeConfig.weight_formats` for `quantization`: () for none and int8 (the config fills
    int8's), the .gguf's formats for gguf."""
    if quantization == "gguf":
        raise ValueError("quantization 'gguf' is not available yet")
    return ()
