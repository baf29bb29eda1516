"""GGUF files read natively: each tensor's blocks become a weight format's stored tensors as they
are (no dequantise-then-requantise), under HF tensor names.

- The container (`GgufFile`): the header's scalar metadata and tensor table are parsed by
  `gguf_header.py` (the `gguf` package's `GGUFReader` spends ~2 s building every tokenizer
  string of a 49k-token vocabulary; only the sizes are walked there), the tensor data
  memory-mapped; types and block
  sizes are the `gguf` package's.
- Names: llama.cpp's (`token_embd`, `blk.N.attn_q`, ...) -> HF's (`model.embed_tokens`,
  `model.layers.N.self_attn.q_proj`, ...) for the Llama-like families we serve (`llama`,
  `qwen2` with q/k/v biases, `qwen3` with q/k norms); tensors we do not map are never read.
- Blocks -> planes (`formats.py`'s layouts): Q8_0 (fp16 d, 32 int8) -> `q8_0`; Q4_0 (fp16 d,
  16 bytes) -> `q4_0`; Q4_1 (fp16 d, fp16 m, 16 bytes) -> `q4_1`; Q5_0 and Q5_1 (Q4_0's and
  Q4_1's with 4 bytes of fifth bits before the 16) -> `q5_0`, `q5_1`; Q4_K, Q5_K, Q6_K ->
  `q4_k`, `q5_k`, `q6_k`, whose one plane is the whole super-block: a view of the mapped file,
  not a copy; F32, F16 and BF16 tensors are dense. Every plane keeps the output rows first.
- llama.cpp's converter interleaves the rotary halves of each head's q and k rows for `llama`
  (`LlamaModel.permute`); the rows of every plane are put back in HF's order here, as
  transformers' `LlamaTensorProcessor` does for its dequantised weights.
- `gguf_weight_formats`: the `RuntimeConfig.weight_formats` and `layer_groups` a file serves
  (layers whose linears are stored in other types form further groups, each with programs of its
  own; a fused linear's parts stored in different types are named apart and split), refusing
  types we do not read.
"""

from __future__ import annotations

import mmap
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

from vllm_aot.models.config import ModelArch
from vllm_aot.models.formats import dense_format
from vllm_aot.models.gguf_header import HeaderCursor
from vllm_aot.models.linear import EMBEDDING, LM_HEAD, CheckpointFormats, part_name
from vllm_aot.models.registry import family_of

GgmlType = GGMLQuantizationType
DENSE_TYPES = {
    GgmlType.F32: torch.float32,
    GgmlType.F16: torch.float16,
    GgmlType.BF16: torch.bfloat16,
}
# GGUF architecture -> our family; llama.cpp permutes q/k rows of the `llama` architecture only.
FAMILY_OF_ARCHITECTURE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTES_QK = ("llama",)
ALL_LINEARS = "*"  # `RuntimeConfig.weight_formats`' name for every linear not named

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class _Plane:
    name: str  # the format's stored tensor name
    start: int  # its bytes [start, stop) in every block
    stop: int
    dtype: torch.dtype


# The quantised block types we read: (our format, its planes in `tensor_names` order).
BLOCK_TYPES: Mapping[GgmlType, tuple[str, tuple[_Plane, ...]]] = {
    GgmlType.Q8_0: (
        "q8_0",
        (_Plane("qweight", 2, 34, torch.int8), _Plane("scale", 0, 2, torch.float16)),
    ),
    GgmlType.Q4_0: (
        "q4_0",
        (_Plane("qweight", 2, 18, torch.uint8), _Plane("scale", 0, 2, torch.float16)),
    ),
    GgmlType.Q4_1: (
        "q4_1",
        (
            _Plane("qweight", 4, 20, torch.uint8),
            _Plane("scale", 0, 2, torch.float16),
            _Plane("min", 2, 4, torch.float16),
        ),
    ),
    GgmlType.Q5_0: (
        "q5_0",
        (
            _Plane("qweight", 6, 22, torch.uint8),
            _Plane("qh", 2, 6, torch.uint8),
            _Plane("scale", 0, 2, torch.float16),
        ),
    ),
    GgmlType.Q5_1: (
        "q5_1",
        (
            _Plane("qweight", 8, 24, torch.uint8),
            _Plane("qh", 4, 8, torch.uint8),
            _Plane("scale", 0, 2, torch.float16),
            _Plane("min", 2, 4, torch.float16),
        ),
    ),
    **{
        ggml_type: (fmt, (_Plane("blocks", 0, GGML_QUANT_SIZES[ggml_type][1], torch.uint8),))
        for ggml_type, fmt in (
            (GgmlType.Q4_K, "q4_k"),
            (GgmlType.Q5_K, "q5_k"),
            (GgmlType.Q6_K, "q6_k"),
        )
    },
}
SUPPORTED_TYPES = ", ".join(t.name for t in [*BLOCK_TYPES, *DENSE_TYPES])


class GgufWeight(NamedTuple):
    """One tensor as the file stores it."""

    type: GgmlType
    format: str | None  # the quantised format of `tensors`; None: one dense float tensor
    tensors: tuple[torch.Tensor, ...]  # the format's stored tensors, or (dense [out, in] | [n],)


@dataclass(frozen=True)
class GgufTensor:
    type: GgmlType
    shape: tuple[int, ...]  # torch order: [out, in] or [n]
    offset: int  # of its data, in bytes from the file's start


class GgufFile:
    """An opened `.gguf`: its metadata (scalars) and tensors by HF name, read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(mapped, dtype=np.uint8)  # the tensors' bytes, read on demand
        header = HeaderCursor(mapped)
        magic, version, num_tensors, num_fields = header.read("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{self.path} is not a GGUF file of version 2 or 3 (little-endian)")
        fields = {}
        for _ in range(num_fields):
            key = header.string()
            fields[key] = header.value(header.read("<I"))
        self.metadata: Mapping[str, object] = {k: v for k, v in fields.items() if v is not None}
        table = []
        for _ in range(num_tensors):
            name = header.string()
            dims = header.read(f"<{header.read('<I')}Q")
            dims = (dims,) if isinstance(dims, int) else dims
            table.append(
                (name, tuple(reversed(dims)), GgmlType(header.read("<I")), header.read("<Q"))
            )
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        start = -(-header.pos // alignment) * alignment
        self.architecture = str(self.metadata.get("general.architecture"))
        if self.architecture not in FAMILY_OF_ARCHITECTURE:
            raise ValueError(
                f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(FAMILY_OF_ARCHITECTURE)}"
            )
        self.data_start = start  # the header (metadata, tensor table) is the bytes before
        self.tensors: Mapping[str, GgufTensor] = {
            hf: GgufTensor(ggml_type, shape, start + offset)
            for name, shape, ggml_type, offset in table
            if (hf := hf_name(name)) is not None
        }
        # Tensors under llama.cpp's names that no HF weight comes from, e.g. `rope_freqs.weight`.
        self.unmapped: Mapping[str, GgufTensor] = {
            name: GgufTensor(ggml_type, shape, start + offset)
            for name, shape, ggml_type, offset in table
            if hf_name(name) is None
        }

    def check_family(self, arch: ModelArch) -> None:
        """Refuse a file of another family than the model directory's config.json states."""
        family = FAMILY_OF_ARCHITECTURE[self.architecture]
        if family != arch.family:
            raise ValueError(
                f"{self.path.name} holds a {self.architecture} model but config.json says "
                f"{arch.architecture} (family {arch.family})"
            )

    def field(self, key: str, default: object = None) -> object:
        """Metadata `key` under this file's architecture, e.g. "attention.head_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def weight(self, name: str) -> GgufWeight:
        """HF tensor `name` as stored: a quantised format's planes or one dense tensor, q/k rows
        in HF's order. Raises KeyError naming a missing tensor, ValueError for a type we do not
        read."""
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} missing from {self.path}")
        tensor = self.tensors[name]
        weight = _split(self.data, tensor, f"{name} in {self.path.name}")
        num_heads = self._permuted_heads(name)
        if num_heads is None:
            return weight
        rows = _unpermuted_rows(tensor.shape[0], num_heads)
        return weight._replace(tensors=tuple(t.index_select(0, rows) for t in weight.tensors))

    def _permuted_heads(self, name: str) -> int | None:
        """The head count llama.cpp permuted `name`'s rows by (None when it did not)."""
        if self.architecture not in _PERMUTES_QK:
            return None
        heads = int(self.field("attention.head_count"))
        if ".self_attn.q_proj." in name:
            return heads
        if ".self_attn.k_proj." in name:
            return int(self.field("attention.head_count_kv", heads))
        return None


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> HF's (None for a tensor we do not read, e.g. `rope_freqs`)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermuted_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row indices undoing llama.cpp's permute: its row (head, j, half) is HF's (head, half, j)."""
    per_half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, per_half, 2).transpose(1, 2).reshape(-1)


def _split(data: np.ndarray, tensor: GgufTensor, what: str) -> GgufWeight:
    """The tensor's bytes -> its planes (copies: each plane one contiguous tensor; a plane that
    spans the whole block is a read-only view of the mapped file, never written)."""
    rows = int(np.prod(tensor.shape[:-1]))
    block_size, block_bytes = GGML_QUANT_SIZES[tensor.type]
    num_bytes = rows * tensor.shape[-1] // block_size * block_bytes
    raw = data[tensor.offset : tensor.offset + num_bytes]
    if tensor.type in DENSE_TYPES:
        dense = torch.from_numpy(np.array(raw)).view(DENSE_TYPES[tensor.type])
        return GgufWeight(tensor.type, None, (dense.reshape(tensor.shape),))
    if tensor.type not in BLOCK_TYPES:
        raise ValueError(f"{what} is {tensor.type.name}; supported types: {SUPPORTED_TYPES}")
    fmt, planes = BLOCK_TYPES[tensor.type]
    if len(planes) == 1 and (planes[0].start, planes[0].stop) == (0, block_bytes):
        with warnings.catch_warnings():  # the mapping is read-only, as a weight is
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return GgufWeight(tensor.type, fmt, (torch.from_numpy(raw.reshape(rows, -1)),))
    blocks = raw.reshape(rows, -1, block_bytes)
    tensors = tuple(
        torch.from_numpy(np.ascontiguousarray(blocks[..., p.start : p.stop]))
        .view(p.dtype)
        .reshape(rows, -1)
        for p in planes
    )
    return GgufWeight(tensor.type, fmt, tensors)


def find_gguf(model_dir: str | Path) -> Path:
    """The `.gguf` a model is read from: the model itself when it is a file, else the one
    `*.gguf` of its directory (beside its config.json and tokenizer)."""
    if Path(model_dir).is_file():
        return Path(model_dir)
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise ValueError(f"quantization 'gguf' reads the one *.gguf in {model_dir}; found {what}")
    return found[0]


def type_format(ggml_type: GgmlType, dtype: torch.dtype, what: str) -> str:
    """The weight format a tensor type is served in: its block format, or the dense format of
    the programs' `dtype`; ValueError naming the supported types."""
    if ggml_type in BLOCK_TYPES:
        return BLOCK_TYPES[ggml_type][0]
    if ggml_type in DENSE_TYPES:
        return dense_format(dtype).name
    raise ValueError(f"{what} is {ggml_type.name}; supported types: {SUPPORTED_TYPES}")


def _linear_types(
    gguf: GgufFile, arch: ModelArch, sources: tuple[str, ...]
) -> list[tuple[GgmlType, ...]]:
    """The types of a layer linear's parts (`sources`) in each layer."""
    prefix = family_of(arch).layer_prefix
    by_layer = []
    for index in range(arch.num_layers):
        names = [f"{prefix.format(index=index)}{source}.weight" for source in sources]
        missing = [n for n in names if n not in gguf.tensors]
        if missing:
            raise KeyError(f"weight {missing[0]!r} missing from {gguf.path}")
        by_layer.append(tuple(gguf.tensors[n].type for n in names))
    return by_layer


def gguf_weight_formats(path: str | Path, arch: ModelArch, dtype: torch.dtype) -> CheckpointFormats:
    """The `RuntimeConfig.weight_formats` and `layer_groups` serving `path`. The layers whose
    linears are stored alike form a group; group 0 is the most layers' (the earliest on a tie).
    `weight_formats`: "*" the format most of group 0's linears and the embedding and head are
    stored in, then each of them stored otherwise, e.g.
    (("*", "q4_1"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0")); `layer_groups`: each
    further group's layers and the linears it stores otherwise than group 0 (llama.cpp's
    Q4_K_M keeps some layers' `attn_v` and `ffn_down` in more bits). A fused linear whose parts
    some layer stores in different types is named by its parts (`linear.part_name`:
    "qkv_proj.2" for v), and is split where they differ (`linear.split_by_format`). Dense
    tensors are served in the dense format of `dtype`; the head is the embedding's when the
    file has no `output`."""
    gguf = GgufFile(path)
    gguf.check_family(arch)
    family = family_of(arch)
    by_linear: dict[str, list[str]] = {}
    for linear in family.layer_spec(arch, dense_format(dtype).name).linears():
        what = f"{path}: {linear.name}"
        by_layer = [
            [type_format(t, dtype, what) for t in types]
            for types in _linear_types(gguf, arch, linear.sources)
        ]
        if all(len(set(parts)) == 1 for parts in by_layer):
            by_linear[linear.name] = [parts[0] for parts in by_layer]
            continue
        for i in range(len(linear.sources)):
            by_linear[part_name(linear.name, i)] = [parts[i] for parts in by_layer]
    # each layer's (linear, format) pairs
    layouts = [tuple((n, f[i]) for n, f in by_linear.items()) for i in range(arch.num_layers)]
    counts = Counter(layouts)
    base = max(counts, key=lambda layout: (counts[layout], -layouts.index(layout)))
    formats = dict(base)
    head = family.head_source(arch, has_head=f"{family.lm_head}.weight" in gguf.tensors)
    for name, source in ((EMBEDDING, family.embedding), (LM_HEAD, head)):
        tensor = f"{source}.weight"
        if tensor not in gguf.tensors:
            raise KeyError(f"weight {tensor!r} missing from {path}")
        formats[name] = type_format(gguf.tensors[tensor].type, dtype, f"{path}: {tensor}")
    default = Counter(formats.values()).most_common(1)[0][0]
    named = [(name, fmt) for name, fmt in formats.items() if fmt != default]
    others = sorted(set(layouts) - {base}, key=layouts.index)
    groups = tuple(
        (
            tuple(i for i, layout in enumerate(layouts) if layout == other),
            tuple(sorted(set(other) - set(base))),
        )
        for other in others
    )
    return CheckpointFormats(tuple(sorted([(ALL_LINEARS, default), *named])), groups)
