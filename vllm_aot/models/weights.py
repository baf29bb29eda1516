"""HF safetensors directory -> our fused parameters, loaded once and shared by every program."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from vllm_aot.models.config import ModelArch
from vllm_aot.models.layers import LayerWeights


class ModelWeights(NamedTuple):
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    def num_bytes(self) -> int:
        tensors = [self.embed, self.final_norm, self.lm_head]
        tensors += [t for layer in self.layers for t in layer if t is not None]
        unique = {t.data_ptr(): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return tensors


def load_weights(model_dir: str | Path, arch: ModelArch, dtype: torch.dtype) -> ModelWeights:
    """Read, fuse (q|k|v and gate|up) and cast every parameter. Raises KeyError on a missing one."""
    raw = _read_tensors(Path(model_dir))

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return raw[name].to(dtype).contiguous()

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                wqkv=torch.cat([take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]),
                bqkv=(
                    torch.cat([take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")])
                    if arch.has_qkv_bias
                    else None
                ),
                q_norm=take(attn + "q_norm.weight") if arch.has_qk_norm else None,
                k_norm=take(attn + "k_norm.weight") if arch.has_qk_norm else None,
                wo=take(attn + "o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                w13=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                w2=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    tied = arch.tie_word_embeddings or "lm_head.weight" not in raw
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=embed if tied else take("lm_head.weight"),
    )
