"""A `.gguf` file as a model of its own: the HF config its metadata states, and the directory of
what vLLM and tokenizers read beside a model.

- `hf_config`: llama.cpp's metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...) ->
  the HF config dictionary our families parse, as transformers' `GGUF_CONFIG_MAPPING` maps it:
  `llama` (Llama 2/3, SmolLM2, Mistral) -> LlamaForCausalLM, `qwen2` -> Qwen2ForCausalLM,
  `qwen3` -> Qwen3ForCausalLM. The vocabulary is the embedding's rows, the head tied when the
  file has no `output` tensor, float32 values as they are (an epsilon of 1e-5 reads
  9.9999997e-06, as transformers reads it: the bundled model's directory and file share their
  programs), Llama 3's rotary scaling read back from the `rope_freqs` factors
  llama.cpp's converter stores in its place.
- `companion_dir`: a model directory for one file, prepared once under `paths.models_dir()`:
  config.json, generation_config.json and the tokenizer (converted by transformers from the
  file's `tokenizer.*` metadata, its chat template with it) beside a link to the file. vLLM
  serves that directory (`plugin/gguf_model.py`); the weights stay in the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from vllm_aot.models.config import RopeSpec
from vllm_aot.models.gguf import FAMILY_OF_ARCHITECTURE, GgufFile

logger = logging.getLogger(__name__)

# GGUF architecture -> the HF architecture name its config states.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
assert set(HF_ARCHITECTURES) == set(FAMILY_OF_ARCHITECTURE)
# Bump when `companion_dir` writes something else.
COMPANION_VERSION = 1
_MARKER = ".vllm-aot-gguf.json"
# Llama 3's rotary scaling besides its factor (every Llama 3.1/3.2 states these).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_LENGTH = 8192


def is_gguf_file(source: str | Path) -> bool:
    """Whether a model argument names a `.gguf` file (not a directory)."""
    path = Path(source)
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def hf_config(file: GgufFile) -> dict[str, Any]:
    """The HF config dictionary `file`'s metadata states (ValueError for a rotary scaling we do
    not run; the family's own refusals come when it parses the result)."""
    field = file.field
    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    head_dim = int(field("attention.key_length", field("rope.dimension_count", hidden // heads)))
    theta = float(field("rope.freq_base", 10000.0))
    embedding = file.tensors.get("model.embed_tokens.weight")
    if embedding is None:
        raise KeyError(f"weight 'model.embed_tokens.weight' missing from {file.path}")
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[file.architecture]],
        "model_type": file.architecture,
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(field("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in file.tensors,
        "hidden_act": "silu",
    }
    for key in ("bos", "eos", "padding"):
        token = file.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token)
    scaling = _rope_scaling(file, head_dim, theta)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(file: GgufFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The HF `rope_scaling` of `file`: its metadata's (`rope.scaling.type`, linear or another
    the config parser names), or Llama 3's, read back from the `rope_freqs` factors."""
    kind = file.field("rope.scaling.type")
    if kind not in (None, "none"):
        return {"rope_type": str(kind), "factor": float(file.field("rope.scaling.factor", 1.0))}
    freqs = file.unmapped.get("rope_freqs.weight")
    if freqs is None:
        return None
    if freqs.type != GGMLQuantizationType.F32:
        raise ValueError(f"{file.path.name}: rope_freqs is {freqs.type.name}, expected F32")
    count = int(np.prod(freqs.shape))
    factors = file.data[freqs.offset : freqs.offset + 4 * count].view(np.float32)
    factor = float(factors.max())
    spec = RopeSpec(
        theta=theta,
        head_dim=head_dim,
        kind="llama3",
        factor=factor,
        original_max_position=_LLAMA3_ORIGINAL_LENGTH,
        **_LLAMA3_ROPE,
    )
    plain = RopeSpec(theta=theta, head_dim=head_dim).inv_freq()
    stored = plain / torch.from_numpy(factors.copy())
    if count != head_dim // 2 or not torch.allclose(spec.inv_freq(), stored, rtol=1e-4):
        raise ValueError(
            f"{file.path.name}: its rope_freqs factors are not Llama 3's rotary scaling "
            f"(factor {factor:g}, low/high frequency factors 1/4, original length "
            f"{_LLAMA3_ORIGINAL_LENGTH}); supported rotary scalings: none, linear, llama3"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL_LENGTH,
        **_LLAMA3_ROPE,
    }


def header_digest(file: GgufFile) -> str:
    """The digest of `file`'s header: its metadata and tensor table, which everything but the
    weights derives from."""
    return hashlib.sha256(file.data[: file.data_start]).hexdigest()[:16]


def companion_dir(path: str | Path, models_root: Path | None = None) -> Path:
    """The model directory of `path`: its config.json, generation_config.json and tokenizer
    (converted from its metadata once, then read from here) beside a link to the file itself,
    so that the directory is an ordinary GGUF model directory (`gguf.find_gguf` finds the file).
    Named by the file's place and header: another file, or this one rewritten with another
    header, has another. ValueError naming the supported architectures for a file of another."""
    from vllm_aot import paths
    from vllm_aot.models.prepare import prepare_once

    file = GgufFile(path)
    config = hf_config(file)
    real = file.path.resolve()
    name = hashlib.sha256(f"{real}\n{header_digest(file)}".encode()).hexdigest()[:16]
    target = (models_root or paths.models_dir()) / f"gguf-{name}"

    def is_ready(directory: Path) -> bool:
        try:
            marker = json.loads((directory / _MARKER).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(marker, dict) and marker.get("version") == COMPANION_VERSION

    def build() -> None:
        from vllm_aot.files import staged_dir

        logger.info("vllm-aot: reading the tokenizer of %s into %s (once)", file.path, target)
        with staged_dir(target) as staging:
            (staging / real.name).symlink_to(real)
            _write_companion(file, config, staging)
            marker = {"version": COMPANION_VERSION, "source": str(real)}
            (staging / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))

    return prepare_once(target, is_ready, build, force=False)


def _write_companion(file: GgufFile, config: dict[str, Any], out_dir: Path) -> None:
    from transformers import AutoTokenizer

    (out_dir / "config.json").write_text(
        json.dumps({**config, "_name_or_path": file.path.name}, indent=2, sort_keys=True)
    )
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if "tokenizer.ggml.model" not in file.metadata:
        logger.warning("vllm-aot: %s carries no tokenizer; give one (--tokenizer)", file.path)
        return
    # From `out_dir`, which holds the link to the file and nothing else of a tokenizer's: the
    # file's directory may hold tokenizer files transformers would read instead.
    link = out_dir / file.path.resolve().name
    tokenizer = AutoTokenizer.from_pretrained(out_dir, gguf_file=link.name)
    tokenizer.save_pretrained(out_dir)
