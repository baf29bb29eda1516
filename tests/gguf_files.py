"""Tiny GGUF files written the way llama.cpp's converter writes them, and the weights transformers'
GGUF loader reads back from them (the reference our planes must equal); for tests.

`write_gguf` takes an HF directory (`models/tiny.py`): tensors renamed by the `gguf` package's
name map, q and k rows permuted for `llama` (`convert_hf_to_gguf.LlamaModel.permute`), each
quantised with `gguf.quants` in the type asked (the K-quants, which `gguf.quants` cannot
quantise, by our formats' `prepare`); the output directory holds config.json, the
tokenizer and `model.gguf`, no safetensors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from vllm_aot.models.config import ModelArch
from vllm_aot.models.formats import WEIGHT_FORMATS
from vllm_aot.models.source import load_arch
from vllm_aot.models.tiny import TOKENIZER_FILES

GgmlType = gguf.GGMLQuantizationType
GGUF_ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
K_QUANTS = {GgmlType.Q4_K: "q4_k", GgmlType.Q5_K: "q5_k", GgmlType.Q6_K: "q6_k"}


def quantize(data: np.ndarray, qtype: GgmlType) -> np.ndarray:
    """A tensor's bytes in `qtype`, as `gguf.quants.quantize` gives them."""
    if qtype in K_QUANTS:
        (blocks,) = WEIGHT_FORMATS[K_QUANTS[qtype]].prepare(torch.from_numpy(data))
        return blocks.numpy()
    return gguf.quants.quantize(data, qtype)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """`convert_hf_to_gguf.LlamaModel.permute`: each head's rotary halves interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_names(family: str, hf_names: list[str], num_layers: int) -> dict[str, str]:
    """HF tensor name -> llama.cpp's, by the `gguf` package's own map."""
    name_map = gguf.get_tensor_name_map(GGUF_ARCHITECTURES[family], num_layers)
    return {n: name_map.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf_names}


def write_gguf(
    hf_dir: Path,
    out_dir: Path,
    *,
    family: str,
    linear_type: GgmlType = GgmlType.Q4_1,
    vocab_type: GgmlType = GgmlType.Q8_0,
    types: Mapping[str, GgmlType] | None = None,
    file_name: str = "model.gguf",
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """`out_dir` with config.json, the tokenizer and `file_name` of `hf_dir`'s weights: layer
    linears in `linear_type`, embedding and head in `vocab_type`, vectors F32, any HF name in
    `types` as given there (a numpy dtype: a tensor of that dtype, e.g. F64). The file's
    metadata are what llama.cpp's converter writes: the model's numbers and (`with_tokenizer`)
    its tokenizer; `extra` adds its own (metadata, tensors) before the weights."""
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = gguf_names(family, list(tensors), config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out_dir.mkdir(parents=True, exist_ok=True)
    arch_name = gguf.MODEL_ARCH_NAMES[GGUF_ARCHITECTURES[family]]
    writer = gguf.GGUFWriter(out_dir / file_name, arch_name)
    add_model_metadata(writer, load_arch(hf_dir))
    if with_tokenizer:
        add_tokenizer_metadata(writer, hf_dir, config)
    if extra is not None:
        extra(writer)
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if family == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, heads, heads)
        if family == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, heads, kv_heads)
        default = (
            GgmlType.F32 if data.ndim == 1 else vocab_type if name in VOCAB_ROWS else linear_type
        )
        qtype = (types or {}).get(name, default)
        if not isinstance(qtype, GgmlType):  # a numpy dtype, written as it is
            writer.add_tensor(names[name], data.astype(qtype))
            continue
        writer.add_tensor(names[name], quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in ("config.json", *TOKENIZER_FILES):
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    return out_dir


def add_model_metadata(writer: gguf.GGUFWriter, arch: ModelArch) -> None:
    """`{arch}.*`: the numbers llama.cpp's converter writes for a Llama-like model."""
    writer.add_block_count(arch.num_layers)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope.theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)


def add_tokenizer_metadata(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    """`tokenizer.*` of `hf_dir`'s byte-level BPE tokenizer (SmolLM2's) as llama.cpp's converter
    writes a "gpt2" one: tokens by id, their types, merges, special ids, the chat template."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**tokenizer["model"]["vocab"]}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    vocab |= {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if vocab[t] in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def transformers_weights(model_dir: Path, hf_dir: Path, family: str) -> dict[str, torch.Tensor]:
    """`model_dir/model.gguf` (written from `hf_dir`) as transformers' GGUF loader reads it:
    dequantised by `gguf.quants`, q and k rows put back by its tensor processor, by HF name."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = json.loads((model_dir / "config.json").read_text())
    hf_names = list(load_file(str(hf_dir / "model.safetensors")))
    names = gguf_names(family, hf_names, config["num_hidden_layers"])
    hf_of = {gguf_name: hf for hf, gguf_name in names.items()}
    processor = TENSOR_PROCESSORS.get(family, TensorProcessor)(config=config)
    weights = {}
    for tensor in gguf.GGUFReader(model_dir / "model.gguf").tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = processor.process(weights=data, name=tensor.name).weights
        weights[hf_of[tensor.name]] = torch.from_numpy(np.array(data, dtype=np.float32))
    return weights


def write_dense_twin(model_dir: Path, weights: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """An HF directory of `weights` (fp32 safetensors) beside `model_dir`'s config and
    tokenizer: the dense model built from the same dequantised weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out_dir / "model.safetensors"))
    for name in ("config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir
