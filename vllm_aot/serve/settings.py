"""`vllm-aot serve` flags -> the vLLM flags and `--additional-config` every replica gets (pure).

Each shape comes from, in order: an exported directory's manifest (fixes every shape; a flag
that contradicts it is refused), the serve flags (or the same vLLM flag passed through), a
configuration the compile-cache registry picked (`registry_choice`: selected to agree with every
flag given, it also brings its block size, chunk and bucket sets), else the platform's defaults
(nothing passed, so `AotOptions` decides as for plain vLLM).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

# serve flag -> (the vLLM flag that carries it, the RuntimeConfig/manifest field it fixes)
_SHAPE_FLAGS = {
    "batch_size": ("--max-num-seqs", "max_num_seqs"),
    "max_model_len": ("--max-model-len", "max_model_len"),
    "dtype": ("--dtype", "dtype"),
    "quantization": ("--quantization", "quantization"),
    "kv_cache_dtype": ("--kv-cache-dtype", "kv_cache_dtype"),
}
# vLLM flags that an exported directory's manifest fixes, besides the three above.
_MANIFEST_ONLY_FLAGS = {
    "--block-size": "block_size",
    "--max-num-batched-tokens": "max_num_batched_tokens",
}
_DEFAULTS = {
    "batch_size": "32 (vllm-aot default)",
    "max_model_len": "2048, or the model's limit if smaller (vllm-aot default)",
    "dtype": "the model's (vLLM's auto)",
    "quantization": "none (the checkpoint's dense weights in dtype)",
    "kv_cache_dtype": "auto (the dtype)",
}


@dataclass(frozen=True)
class ShapeFlags:
    """Shapes asked for on the command line; None = not given."""

    batch_size: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RegistryPick:
    """A compiled configuration from the cache registry: its RuntimeConfig shape fields."""

    runtime: dict[str, Any]
    why: str = "compiled configuration in the cache registry"

    @property
    def extra_fields(self) -> dict[str, Any]:
        """What `--additional-config` must carry besides the three shape flags."""
        flagged = {key for _, key in _SHAPE_FLAGS.values()}
        flagged |= {"tensor_parallel_size", "enable_expert_parallel"}  # vLLM's own flags
        return {k: v for k, v in self.runtime.items() if k not in flagged}


@dataclass(frozen=True)
class ChosenConfig:
    """What each replica runs with, and why (one line per shape, for the user)."""

    vllm_args: tuple[str, ...]  # shape flags, then the passthrough flags (minus additional-config)
    additional_config: dict[str, Any] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        return "configuration:\n" + "\n".join(f"  {line}" for line in self.reasons)


def _is_flag(name: str, flag: str) -> bool:
    return name.startswith("--") and name.replace("_", "-") == flag


def flag_value(args: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The last value of `--flag v` / `--flag=v` in vLLM-style args (underscores allowed)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if not _is_flag(name, flag):
            continue
        if eq:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def flag_values(args: tuple[str, ...] | list[str], flag: str) -> tuple[str, ...] | None:
    """The values of the last `--flag a b ...` / `--flag=a`: a vLLM list flag (nargs="+", the
    last occurrence wins, values run up to the next option)."""
    values = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if not _is_flag(name, flag):
            continue
        following = itertools.takewhile(lambda a: not a.startswith("-"), args[i + 1 :])
        values = (inline,) if eq else tuple(following)
    return values


def without_flag(args: tuple[str, ...] | list[str], flag: str) -> tuple[str, ...]:
    """`args` minus every `--flag v` / `--flag=v`."""
    kept: list[str] = []
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _is_flag(name, flag):
            skip_next = not eq
            continue
        kept.append(arg)
    return tuple(kept)


def _merge_additional_config(
    ours: dict[str, Any], passthrough: tuple[str, ...]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    text = flag_value(passthrough, "--additional-config")
    if text is None:
        return ours, passthrough
    try:
        theirs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--additional-config is not JSON: {exc}") from None
    clashes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    if clashes:
        raise ValueError(
            f"--additional-config sets {', '.join(clashes)}, which serve flags also set "
            f"differently ({', '.join(f'{k}={ours[k]!r}' for k in clashes)}); give each once"
        )
    return {**ours, **theirs}, without_flag(passthrough, "--additional-config")


def speculative_tokens(passthrough: tuple[str, ...]) -> int:
    """Drafts per step `--speculative-config` asks for (0 without it): the verify programs'."""
    text = flag_value(passthrough, "--speculative-config")
    return int(json.loads(text).get("num_speculative_tokens") or 0) if text else 0


def _speculative_reason(passthrough: tuple[str, ...]) -> str:
    text = flag_value(passthrough, "--speculative-config")
    if not text:
        return "speculative decoding off (--speculative-config)"
    spec = json.loads(text)
    return (
        f"speculative decoding: {spec.get('method')} with {speculative_tokens(passthrough)} "
        "drafts a step (from --speculative-config)"
    )


def _same(flag_text: str, manifest_value: Any) -> bool:
    return str(flag_text).removeprefix("torch.") == str(manifest_value)


def choose_config(
    flags: ShapeFlags,
    *,
    passthrough: tuple[str, ...] = (),
    manifest: dict[str, Any] | None = None,
    artifact_dir: str | None = None,
    registry_choice: RegistryPick | None = None,
    additional_config: dict[str, Any] | None = None,
) -> ChosenConfig:
    """Decide every replica's shapes (see the module docstring); ValueError on contradictions.

    `manifest` is the exported directory's manifest when the model is one (`read_manifest`).
    """
    config, passthrough = _merge_additional_config(dict(additional_config or {}), passthrough)
    given = {
        name: (getattr(flags, name), flag_value(passthrough, vllm_flag))
        for name, (vllm_flag, _) in _SHAPE_FLAGS.items()
    }
    for name, (ours, theirs) in given.items():
        if ours is not None and theirs is not None and str(ours) != theirs:
            vllm_flag = _SHAPE_FLAGS[name][0]
            raise ValueError(
                f"--{name.replace('_', '-')} {ours} contradicts {vllm_flag} {theirs}; give one"
            )
    if manifest is not None:
        return _from_manifest(manifest, artifact_dir, given, flags, passthrough, config)
    shape_args: list[str] = []
    reasons: list[str] = []
    if registry_choice is not None:
        config = {**registry_choice.extra_fields, **config}
        reasons.append(registry_choice.why)
    for name, (vllm_flag, key) in _SHAPE_FLAGS.items():
        ours, theirs = given[name]
        picked = registry_choice.runtime.get(key) if registry_choice else None
        picked = None if picked == "auto" else picked  # vLLM's default: nothing to pass
        if ours is not None:
            shape_args += [vllm_flag, str(ours)]
            reasons.append(f"{name} = {ours} (from --{name.replace('_', '-')})")
        elif theirs is not None:
            reasons.append(f"{name} = {theirs} (from {vllm_flag})")
        elif picked is not None:
            shape_args += [vllm_flag, str(picked)]
            reasons.append(f"{name} = {picked} (compiled configuration in the cache registry)")
        else:
            reasons.append(f"{name} = {_DEFAULTS[name]}")
    shape_args += _tp_args(flags.tensor_parallel_size)
    reasons += [_tp_reason(flags.tensor_parallel_size), _speculative_reason(passthrough)]
    return ChosenConfig(tuple(shape_args) + passthrough, config, tuple(reasons))


def _tp_args(tensor_parallel_size: int) -> list[str]:
    return ["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size > 1 else []


def _tp_reason(tensor_parallel_size: int) -> str:
    if tensor_parallel_size == 1:
        return "tensor_parallel_size = 1"
    return (
        f"tensor_parallel_size = {tensor_parallel_size} (vLLM's executor runs a worker per "
        "rank, each on its share of the replica's cores)"
    )


def _from_manifest(
    manifest: dict[str, Any],
    artifact_dir: str | None,
    given: dict[str, tuple[Any, str | None]],
    flags: ShapeFlags,
    passthrough: tuple[str, ...],
    config: dict[str, Any],
) -> ChosenConfig:
    shapes = manifest["config"]
    where = f"exported directory {artifact_dir}" if artifact_dir else "exported directory"
    conflicts = []
    for name, (vllm_flag, key) in _SHAPE_FLAGS.items():
        if key not in shapes:  # exported before the field existed: its default
            continue
        for text, label in zip(
            given[name], (f"--{name.replace('_', '-')}", vllm_flag), strict=True
        ):
            if text is not None and not _same(text, shapes[key]):
                conflicts.append(f"{label} {text} (it was compiled for {shapes[key]})")
    for vllm_flag, key in _MANIFEST_ONLY_FLAGS.items():
        text = flag_value(passthrough, vllm_flag)
        if text is not None and not _same(text, shapes[key]):
            conflicts.append(f"{vllm_flag} {text} (it was compiled for {shapes[key]})")
    tp = shapes.get("tensor_parallel_size", 1)
    if flags.tensor_parallel_size not in (1, tp):
        conflicts.append(
            f"--tensor-parallel-size {flags.tensor_parallel_size} (it was compiled for {tp})"
        )
    if conflicts:
        raise ValueError(
            f"the {where} fixes its shapes; these flags contradict it: {'; '.join(conflicts)}. "
            "Drop them, or export again with the configuration you need."
        )
    reasons = [
        f"{name} = {shapes.get(key)} (from the {where})" for name, (_, key) in _SHAPE_FLAGS.items()
    ]
    return ChosenConfig((*_tp_args(tp), *passthrough), config, (*reasons, _tp_reason(tp)))
