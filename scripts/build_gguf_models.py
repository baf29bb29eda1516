"""GGUF files of bigger models for benchmarks and K-quant accuracy tests, built on this machine.

    .venv/bin/python scripts/build_gguf_models.py [--only NAME,...] [--list]

Writes into `<models dir>/gguf-bench/` (vllm_aot/paths.py: `~/.cache/vllm-aot/models/gguf-bench`),
never into the repository:

- `llama-3.2-1b-random-{Q4_K_M,Q8_0}.gguf` and `llama-3.2-3b-random-{Q4_K_M,Q8_0}.gguf`: models
  shaped as Llama-3.2-1B and -3B (llama3 RoPE, tied embeddings) with random weights (seeded
  normal, std 0.02, norms 1: finite activations, meaningless text) and the SmolLM2 tokenizer
  (vocabulary 49152), so every benchmark client tokenises them as it does the bundled model;
- `SmolLM2-135M-Instruct-{F16,Q4_K_M,Q5_K_M,Q6_K}.gguf`: the bundled model (its dequantised
  `model.safetensors`) in llama.cpp's K-quants, and in f16 as their reference. Its width, 576, is
  no multiple of a K-quant super-block (256 values), so llama-quantize gives K-quant blocks only
  to `ffn_down` (rows of 1536) and falls back elsewhere: Q4_K_M has Q4_K and Q6_K `ffn_down`s,
  Q5_0 for the rest (Q8_0 where it meant Q6_K: 14 `attn_v`s and the embeddings); Q5_K_M the same
  with Q5_K and Q5_1; Q6_K has Q6_K `ffn_down`s and Q8_0 for the rest.

Each model is written as HF safetensors (one shard per layer, so a 3B model never sits whole in
memory), converted by llama.cpp's own `convert_hf_to_gguf.py --outtype f16` and quantised by
`llama-quantize`; the HF files and the random models' f16 GGUFs are deleted afterwards (a few GB
each). llama.cpp is the build of scripts/setup_llamacpp.sh (bench/llamacpp.py: where it lives).
Seeded and idempotent: a file that exists is kept, so a rerun only builds what is missing (delete a
file to rebuild it). Prints each file's path, size, tensor types and build time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from llamacpp import BUILD_DIR, LIB_DIR  # noqa: E402

from vllm_aot import paths  # noqa: E402

SEED = 0
STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMOLLM2 = "SmolLM2-135M-Instruct"
LLAMA3_ROPE = {  # Llama-3.2's
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Model:
    name: str
    quants: tuple[str, ...]
    shape: Shape | None = None  # random weights of this shape; None: the bundled SmolLM2
    keep_f16: bool = False


MODELS = (
    Model(SMOLLM2, ("Q4_K_M", "Q5_K_M", "Q6_K"), keep_f16=True),
    Model("llama-3.2-1b-random", ("Q4_K_M", "Q8_0"), Shape(2048, 16, 8192, 32, 8, 64)),
    Model("llama-3.2-3b-random", ("Q4_K_M", "Q8_0"), Shape(3072, 28, 8192, 24, 8, 128)),
)


def out_dir() -> Path:
    return paths.models_dir() / "gguf-bench"


def gguf_path(model: Model, file_type: str) -> Path:
    return out_dir() / f"{model.name}-{file_type}.gguf"


def llamacpp_source() -> Path:
    """llama.cpp's source tree inside the llama-cpp-python sdist that setup_llamacpp.sh built."""
    found = sorted(BUILD_DIR.glob("src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise SystemExit(f"error: no llama.cpp build in {BUILD_DIR}: run scripts/setup_llamacpp.sh")
    return found[-1].parent


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_config(shape: Shape, source_config: dict) -> dict:
    """A Llama-3.2-style config of `shape` with the special-token ids of `source_config`'s model."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=True,
        bos_token_id=source_config["bos_token_id"],
        eos_token_id=source_config["eos_token_id"],
        pad_token_id=source_config.get("pad_token_id"),
        torch_dtype="bfloat16",
    )
    return config.to_dict() | {"architectures": ["LlamaForCausalLM"]}


def layer_shapes(shape: Shape, layer: int) -> dict[str, tuple[int, ...]]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    prefix = f"model.layers.{layer}."
    return {
        prefix + "input_layernorm.weight": (h,),
        prefix + "self_attn.q_proj.weight": (q, h),
        prefix + "self_attn.k_proj.weight": (kv, h),
        prefix + "self_attn.v_proj.weight": (kv, h),
        prefix + "self_attn.o_proj.weight": (h, q),
        prefix + "post_attention_layernorm.weight": (h,),
        prefix + "mlp.gate_proj.weight": (shape.intermediate, h),
        prefix + "mlp.up_proj.weight": (shape.intermediate, h),
        prefix + "mlp.down_proj.weight": (h, shape.intermediate),
    }


def random_tensors(names: dict[str, tuple[int, ...]], seed: int) -> dict:
    """bf16 tensors: norms 1, the rest normal(0, STD) from a generator seeded per shard."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, size in names.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(size, dtype=torch.bfloat16)
        else:
            values = torch.empty(size, dtype=torch.float32).normal_(0.0, STD, generator=generator)
            tensors[name] = values.to(torch.bfloat16)
    return tensors


def write_random_hf(model: Model, hf_dir: Path) -> None:
    """The HF model directory: config, SmolLM2's tokenizer, one safetensors shard per layer
    (plus one for the embeddings and final norm) and the index, written last."""
    from safetensors.torch import save_file

    shape, smollm2 = model.shape, paths.models_dir() / SMOLLM2
    hf_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, hf_dir / name)
    smollm2_config = json.loads((smollm2 / "config.json").read_text())
    config = random_config(shape, smollm2_config)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    shards = [
        {"model.embed_tokens.weight": (49152, shape.hidden), "model.norm.weight": (shape.hidden,)}
    ]
    shards += [layer_shapes(shape, layer) for layer in range(shape.layers)]
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = random_tensors(names, seed=SEED * 100_003 + i)
        save_file(tensors, hf_dir / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
        log(f"  {model.name}: shard {i + 1}/{len(shards)} written ({total / 1e9:.2f} GB)")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def run(command: list[str], env: dict[str, str] | None = None) -> None:
    log("  $ " + " ".join(command))
    subprocess.run(command, check=True, env={**os.environ, **(env or {})})


def convert_f16(source: Path, hf_dir: Path, f16: Path) -> None:
    partial = f16.with_suffix(".partial")
    run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), "--outtype", "f16",
         "--outfile", str(partial), str(hf_dir)],
        env={"PYTHONPATH": str(source / "gguf-py")},  # the gguf-py of the same llama.cpp
    )  # fmt: skip
    partial.rename(f16)


def quantize(f16: Path, target: Path, file_type: str) -> None:
    if not (LIB_DIR / "llama-quantize").is_file():
        raise SystemExit(f"error: no llama-quantize in {LIB_DIR}: run scripts/setup_llamacpp.sh")
    partial = target.with_suffix(".partial")
    threads = str(len(os.sched_getaffinity(0)))
    run([str(LIB_DIR / "llama-quantize"), str(f16), str(partial), file_type, threads])
    partial.rename(target)


def build(model: Model, source: Path, *, f16_only: bool = False) -> dict[str, float]:
    """Every missing file of `model` (with `f16_only`, only its f16 GGUF): seconds per step."""
    f16 = gguf_path(model, "F16")
    targets = [gguf_path(model, q) for q in model.quants] + ([f16] if model.keep_f16 else [])
    if all(t.is_file() for t in targets):
        log(f"{model.name}: all files present")
        return {}
    seconds, begin = {}, time.monotonic()
    hf_dir = out_dir() / f"{model.name}-hf" if model.shape else paths.models_dir() / SMOLLM2
    if not f16.is_file():
        if model.shape and not (hf_dir / "model.safetensors.index.json").is_file():
            log(f"{model.name}: writing random HF weights into {hf_dir}")
            write_random_hf(model, hf_dir)
            seconds["random HF weights"] = time.monotonic() - begin
        log(f"{model.name}: converting to f16 GGUF")
        start = time.monotonic()
        convert_f16(source, hf_dir, f16)
        seconds["F16"] = time.monotonic() - start
    if model.shape:
        shutil.rmtree(hf_dir, ignore_errors=True)
    if f16_only:
        return seconds
    for file_type in model.quants:
        target = gguf_path(model, file_type)
        if not target.is_file():
            log(f"{model.name}: quantising to {file_type}")
            start = time.monotonic()
            quantize(f16, target, file_type)
            seconds[file_type] = time.monotonic() - start
    if not model.keep_f16:
        f16.unlink()
    return seconds


def tensor_types(gguf: Path) -> str:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def report(model: Model, seconds: dict[str, float]) -> None:
    steps = ", ".join(f"{step} {s:.0f} s" for step, s in seconds.items())
    if seconds:
        print(f"{model.name}: built ({steps})")
    for file_type in ("F16", *model.quants):
        file = gguf_path(model, file_type)
        if file.is_file():
            took = f"built in {seconds[file_type]:.0f} s" if file_type in seconds else "present"
            size = file.stat().st_size / 1e9
            print(f"{file}  {size:.3f} GB  {took}\n    tensor types: {tensor_types(file)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated model names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the files and stop")
    parser.add_argument(
        "--f16-only", action="store_true", help="stop at the f16 GGUFs (no llama-quantize needed)"
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else [m.name for m in MODELS]
    if unknown := set(names) - {m.name for m in MODELS}:
        raise SystemExit(f"error: unknown models {sorted(unknown)}")
    models = [m for m in MODELS if m.name in names]
    if args.list:
        for model in models:
            report(model, {})
        return
    source = llamacpp_source()
    out_dir().mkdir(parents=True, exist_ok=True)
    for model in models:
        report(model, build(model, source, f16_only=args.f16_only))


if __name__ == "__main__":
    main()
