"""Tensor capture: chosen module outputs of our runtime and of HF for the same tokens.

Names are HF's module names, so one pattern (fnmatch, e.g. `model.layers.*`) selects the same
tensors on both sides and compare aligns them by name:

- `model.embed_tokens`, `model.layers.{i}` (a layer's output hidden state), `lm_head` (logits);
- `model.layers.{i}.self_attn.key_states` / `.value_states`: the layer's new K/V, post-rotary
  (HF's variable names: these are what its attention writes to its cache, read back from it);
- eager backend only: `model.layers.{i}.input_layernorm`, `.self_attn` (after the output
  projection), `.post_attention_layernorm`, `.mlp` (see `instrument.py`).

Everything but the sub-layer names is a program boundary, so it is captured from the compiled
programs themselves (any backend) and can be *replaced*: `capture_ours(replacements=...)` runs our
model with a module's output swapped for the reference's, to confirm where an error enters.

A `Capture` holds [positions, ...] float32 tensors of one teacher-forced sequence; it saves to a
directory as `tensors.safetensors` plus a small `index.json` (source, dtype, tokens, names).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_aot.accuracy.teacher_forcing import (
    HFReference,
    TokenIds,
    cache_key_values,
    feed_sequence,
    sequence_blocks,
)
from vllm_aot.runtime.model import CompiledModel

INDEX_FILE = "index.json"
TENSORS_FILE = "tensors.safetensors"
SUBLAYER_NAMES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
KV_NAMES = ("self_attn.key_states", "self_attn.value_states")

# Within a layer, in the order the maths produces them (the layer's output last).
_IN_LAYER_ORDER = {
    "input_layernorm": 0,
    "self_attn.key_states": 1,
    "self_attn.value_states": 2,
    "self_attn": 3,
    "post_attention_layernorm": 4,
    "mlp": 5,
    "": 6,
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)(?:\.(.+))?$")


def module_order(name: str) -> tuple[int, int, str]:
    """Sort key putting names in forward order: embedding, layers in order, norm, head."""
    if name == "model.embed_tokens":
        return (-1, 0, name)
    match = _LAYER_NAME.match(name)
    if match:
        return (int(match[1]), _IN_LAYER_ORDER.get(match[2] or "", 7), name)
    return (1 << 30, 0 if name == "model.norm" else 1, name)


def capture_names(num_layers: int, *, has_sublayers: bool = True) -> list[str]:
    """Every name either side can capture, in forward order."""
    names = ["model.embed_tokens"]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        subs = (*SUBLAYER_NAMES, *KV_NAMES) if has_sublayers else KV_NAMES
        names += [f"{prefix}.{sub}" for sub in subs] + [prefix]
    return sorted([*names, "lm_head"], key=module_order)


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True when `name` matches any fnmatch pattern; no patterns select everything."""
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True)
class Capture:
    """Module outputs of one teacher-forced sequence, [positions, ...] float32 per name."""

    source: str  # "ours" or "hf"
    dtype: str  # the dtype the model ran in
    token_ids: tuple[int, ...]
    tensors: Mapping[str, torch.Tensor] = field(repr=False)  # name -> [positions, ...]
    replaced: tuple[str, ...] = ()  # modules whose output was replaced by the reference's

    @property
    def names(self) -> list[str]:
        return sorted(self.tensors, key=module_order)

    def save(self, out_dir: str | Path) -> Path:
        """Write `tensors.safetensors` and `index.json` into `out_dir` (created); returns it."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in self.tensors.items()}, str(out / TENSORS_FILE))
        index = {
            "source": self.source,
            "dtype": self.dtype,
            "token_ids": list(self.token_ids),
            "replaced": list(self.replaced),
            "tensors": {n: list(self.tensors[n].shape) for n in self.names},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        return out

    @classmethod
    def load(cls, capture_dir: str | Path) -> Capture:
        """Read a directory written by `save`; ValueError when it is not one."""
        from safetensors.torch import load_file

        path = Path(capture_dir)
        if not (path / INDEX_FILE).is_file() or not (path / TENSORS_FILE).is_file():
            raise ValueError(f"{path} is not a capture directory (no {INDEX_FILE}/{TENSORS_FILE})")
        index = json.loads((path / INDEX_FILE).read_text())
        return cls(
            source=index["source"],
            dtype=index["dtype"],
            token_ids=tuple(index["token_ids"]),
            tensors=load_file(str(path / TENSORS_FILE)),
            replaced=tuple(index.get("replaced", ())),
        )


class CaptureTap:
    """A `runtime.model.Tap` that records matching tensors of the real tokens of one sequence
    (over any number of steps) and swaps in `replacements` ([positions, ...] per name).

    It also tracks which layer runs next, so the eager instrumented layer can name its sub-layer
    tensors (`sublayer`). One tap serves one sequence; make a new one per capture.
    """

    def __init__(
        self, patterns: Sequence[str] = (), replacements: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self._patterns = tuple(patterns)
        self._replacements = dict(replacements or {})
        self._parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._next_layer = 0
        self._positions = torch.zeros(0, dtype=torch.int64)

    def __call__(self, *, name: str, tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._positions = positions
        if name == "model.embed_tokens":
            self._next_layer = 0
        elif (match := _LAYER_NAME.match(name)) and match[2] is None:
            self._next_layer = int(match[1]) + 1
        num_real = len(positions)
        if name in self._replacements:
            tensor = tensor.clone()
            tensor[:num_real] = self._replacements[name][positions].to(tensor.dtype)
        self.record(name, tensor[:num_real], positions)
        return tensor

    def sublayer(self, suffix: str, tensor: torch.Tensor) -> None:
        """Record `model.layers.{running layer}.{suffix}` (rows: the step's padded tokens)."""
        name = f"model.layers.{self._next_layer}.{suffix}"
        self.record(name, tensor[: len(self._positions)], self._positions)

    def record(self, name: str, tensor: torch.Tensor, positions: torch.Tensor) -> None:
        if matches(name, self._patterns):
            part = (positions.clone(), tensor.detach().float().clone())
            self._parts.setdefault(name, []).append(part)

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> [positions, ...], rows in position order."""
        out = {}
        for name, parts in self._parts.items():
            positions = torch.cat([p for p, _ in parts])
            out[name] = torch.cat([t for _, t in parts])[positions.argsort()]
        return out


def capture_ours(
    model: CompiledModel,
    token_ids: TokenIds,
    patterns: Sequence[str] = (),
    *,
    replacements: Mapping[str, torch.Tensor] | None = None,
    has_sublayers: bool | None = None,
) -> Capture:
    """Teacher-force `token_ids` through `model` (as `our_logits`) and record matching tensors.

    `replacements` (name -> [positions, ...], e.g. an HF capture's tensors) replace program-
    boundary outputs before the step continues. `has_sublayers` (default: on for the eager
    backend) runs an instrumented eager copy of the layer program that also reports sub-layer
    tensors; it is refused for compiled backends, whose graphs have no such boundaries.
    """
    from vllm_aot.accuracy.instrument import instrumented_model

    if has_sublayers is None:
        has_sublayers = model.config.backend == "eager"
    if has_sublayers and model.config.backend != "eager":
        raise ValueError("sub-layer capture needs the eager backend; compiled programs are opaque")
    boundaries = set(capture_names(model.arch.num_layers, has_sublayers=False)) - {"lm_head"}
    unknown = set(replacements or {}) - boundaries
    if unknown:
        raise ValueError(
            f"only program-boundary outputs (embedding, layer outputs, key/value states) can be "
            f"replaced, not {sorted(unknown)}"
        )
    tap = CaptureTap(patterns, replacements)
    runner = instrumented_model(model, tap, len(token_ids)) if has_sublayers else model
    with runner.tapped(tap), sequence_blocks(runner, len(token_ids)) as block_table:
        logits = feed_sequence(runner, token_ids, block_table)
    tensors = tap.tensors()
    if matches("lm_head", patterns):
        tensors["lm_head"] = logits
    return Capture(
        source="ours",
        dtype=model.config.dtype,
        token_ids=tuple(token_ids),
        tensors=tensors,
        replaced=tuple(sorted(replacements or {}, key=module_order)),
    )


def capture_hf(
    reference: HFReference,
    token_ids: TokenIds,
    dtype: torch.dtype | str,
    patterns: Sequence[str] = (),
) -> Capture:
    """HF's outputs of the modules our side can capture (`capture_names`), by forward hooks."""
    model = reference.model(dtype)
    num_layers = model.config.num_hidden_layers
    wanted = [n for n in capture_names(num_layers) if matches(n, patterns)]
    tensors: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(module, args, output) -> None:
            out = output[0] if isinstance(output, tuple) else output
            tensors[name] = out[0].detach().float().clone()  # drop the batch dimension

        return hook

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(hook_for(n)) for n in wanted if n in modules]
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(token_ids)]), use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    for layer, (k, v) in enumerate(cache_key_values(out.past_key_values)):
        for suffix, tensor in zip(KV_NAMES, (k, v), strict=True):
            name = f"model.layers.{layer}.{suffix}"
            if name in wanted:
                tensors[name] = tensor
    dtype_name = str(model.dtype).removeprefix("torch.")
    return Capture(source="hf", dtype=dtype_name, token_ids=tuple(token_ids), tensors=tensors)


def select(capture: Capture, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The capture's tensors for `names`; KeyError naming what is missing."""
    names = list(names)
    missing = [n for n in names if n not in capture.tensors]
    if missing:
        raise KeyError(f"{capture.source} capture has no {missing}; capture them first")
    return {n: capture.tensors[n] for n in names}
