"""vllm-aot: vLLM on ahead-of-time compiled, static-shape model graphs."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> str:
    """The `vllm.platform_plugins` entry point: vLLM activates our platform by this name.

    Called more than once per process, so it imports nothing.
    """
    return "vllm_aot.plugin.platform.AotPlatform"


def register_quantization() -> None:
    """The `vllm.general_plugins` entry point: `--quantization gguf|int8` become names vLLM
    accepts (in every vLLM process, before it validates the flag)."""
    from vllm_aot.plugin.quantization import register

    register()
