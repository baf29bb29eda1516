"""vllm-aot: vLLM on ahead-of-time compiled, static-shape model graphs."""

from __future__ import annotations

__version__ = "0.1.0"


def register() -> str:
    """The `vllm.platform_plugins` entry point: vLLM activates our platform by this name.

    Called more than once per process, so it imports nothing.
    """
    return "vllm_aot.plugin.platform.AotPlatform"
