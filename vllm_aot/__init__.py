"""vllm-aot: vLLM on ahead-of-time compiled, static-shape model graphs."""

from __future__ import annotations

__version__ = "0.1.0"
