"""Where vllm-aot keeps things on disk (and where vLLM keeps the records we carry for it).
Environment variables are read here, on demand."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Root of every vllm-aot cache (`VLLM_AOT_CACHE_DIR`, default `~/.cache/vllm-aot`)."""
    configured = os.environ.get("VLLM_AOT_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-aot"


def runtime_dir() -> Path:
    """Files of this user's running processes (engine stats), in a directory only the user may
    enter (`VLLM_AOT_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/vllm-aot`, else `<cache root>/run`;
    `files.private_dir` makes it)."""
    configured = os.environ.get("VLLM_AOT_RUNTIME_DIR")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "vllm-aot" if xdg else cache_root() / "run"


def models_dir() -> Path:
    """Prepared HF model directories (`VLLM_AOT_MODELS_DIR`, default `<cache root>/models`)."""
    configured = os.environ.get("VLLM_AOT_MODELS_DIR")
    return Path(configured).expanduser() if configured else cache_root() / "models"


def compiled_cache_dir() -> Path:
    """The local compile cache (`VLLM_AOT_COMPILE_CACHE`, default `<cache root>/compiled`)."""
    configured = os.environ.get("VLLM_AOT_COMPILE_CACHE")
    return Path(configured).expanduser() if configured else cache_root() / "compiled"


def vllm_model_infos_dir() -> Path:
    """Where vLLM keeps its records of inspected model classes, by vLLM's own rule
    (`VLLM_CACHE_ROOT`, else `XDG_CACHE_HOME/vllm`, else `~/.cache/vllm`), read without importing
    vLLM."""
    configured = os.environ.get("VLLM_CACHE_ROOT")
    if configured:
        return Path(configured).expanduser() / "modelinfos"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vllm" / "modelinfos"
