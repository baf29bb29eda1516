"""Small helpers shared by tests."""

from __future__ import annotations

from vllm_aot.runtime.config import RuntimeConfig


def tiny_config(**overrides) -> RuntimeConfig:
    """A small eager configuration: 4 rows, 256 tokens, blocks of 16, 64-token prefill chunks."""
    fields = dict(
        max_num_seqs=4,
        max_model_len=256,
        block_size=16,
        max_num_batched_tokens=64,
        dtype="float32",
        backend="eager",
    )
    fields.update(overrides)
    return RuntimeConfig(**fields)
