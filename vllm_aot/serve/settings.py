"""`vllm-aot serve` flags -> the vLLM flags and `--additional-config` every replica gets.

vLLM's flags passed through are read by vLLM's own parser (`plugin/engine_flags.py`) and pinned
with the platform's own `pinned_fields` and `check_artifact`, so serve decides what the platform
will. Each shape comes from, in order: an exported directory's manifest (fixes every shape; a
flag that contradicts it is refused), the serve flags (or the same vLLM flag passed through), a
configuration the compile-cache registry picked (`registry_choice`: selected to agree with every
flag given, it also brings its block size, chunk and bucket sets), else the platform's defaults
(nothing passed, so `AotOptions` decides as for plain vLLM).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from vllm_aot.plugin.engine_flags import VllmFlags, parse_vllm_flags
from vllm_aot.plugin.options import check_artifact, pinned_fields
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.options import BY_NAME, VLLM_OPTIONS

# The options serve flags set, carried to vLLM as its flags (TP apart: the replicas' layout).
SHAPE_OPTIONS = tuple(o for o in VLLM_OPTIONS if o.serve and o.name != "tensor_parallel_size")
# Options a registry pick matched to what vLLM's own flags say: never passed from the pick.
_MATCHED = (
    "tensor_parallel_size",
    "enable_expert_parallel",
    "num_speculative_tokens",
    "runner",
    "convert",
)


@dataclass(frozen=True)
class ShapeFlags:
    """Shapes asked for on the command line; None = not given."""

    batch_size: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = 1

    def given(self) -> dict[str, Any]:
        """The options these flags set (option name -> value)."""
        values = {o.name: getattr(self, o.dest) for o in SHAPE_OPTIONS}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class RegistryPick:
    """A compiled configuration from the cache registry: its RuntimeConfig shape fields."""

    runtime: dict[str, Any]
    why: str = "compiled configuration in the cache registry"

    @property
    def extra_fields(self) -> dict[str, Any]:
        """What `--additional-config` must carry besides the shapes serve's flags carry."""
        flagged = {o.name for o in SHAPE_OPTIONS} | set(_MATCHED)
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


API_KEY_FLAG = "--api-key"
# The shortest spelling vLLM's parser takes for --api-key alone (`--api` is also
# --api-server-count); any longer prefix of --api-key is the same flag.
_API_KEY_SHORTEST = "--api-k"


def _is_api_key_flag(arg: str) -> bool:
    name = arg.partition("=")[0].replace("_", "-")
    return name.startswith(_API_KEY_SHORTEST) and API_KEY_FLAG.startswith(name)


def _api_key_values(args: tuple[str, ...] | list[str]) -> list[tuple[int, list[int]]]:
    """Each --api-key flag in `args` (any spelling vLLM takes): its index and its values'
    indices (nargs="+": up to the next option; the flag's own for `--api-key=K`)."""
    found = []
    for i, arg in enumerate(args):
        if not _is_api_key_flag(arg):
            continue
        if "=" in arg:
            found.append((i, [i]))
            continue
        following = itertools.takewhile(
            lambda j: not args[j].startswith("-"), range(i + 1, len(args))
        )
        found.append((i, list(following)))
    return found


def api_keys_given(args: tuple[str, ...] | list[str]) -> tuple[str, ...] | None:
    """The keys of the last --api-key on the command line (the one vLLM takes), or None."""
    found = _api_key_values(args)
    if not found:
        return None
    flag, values = found[-1]
    return tuple(args[j].partition("=")[2] if j == flag else args[j] for j in values)


def without_api_key(args: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`args` minus every --api-key and its values."""
    dropped = {j for i, values in _api_key_values(args) for j in (i, *values)}
    return tuple(a for j, a in enumerate(args) if j not in dropped)


def masked(args: tuple[str, ...] | list[str]) -> list[str]:
    """`args` for printing: every --api-key value shown as ***."""
    shown = list(args)
    for flag, values in _api_key_values(args):
        for j in values:
            shown[j] = f"{args[j].partition('=')[0]}=***" if j == flag else "***"
    return shown


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
    ours: dict[str, Any], passthrough: tuple[str, ...], theirs: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Our --additional-config entries and the passed-through one (`theirs`, as vLLM parsed it)
    as one, which replaces the passed-through flag; ValueError where the two disagree."""
    clashes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    if clashes:
        raise ValueError(
            f"--additional-config sets {', '.join(clashes)}, which serve flags also set "
            f"differently ({', '.join(f'{k}={ours[k]!r}' for k in clashes)}); give each once"
        )
    return {**ours, **theirs}, without_flag(passthrough, "--additional-config")


def _speculative_reason(parsed: VllmFlags) -> str:
    spec = parsed.speculative_config
    if not spec:
        return "speculative decoding off (--speculative-config)"
    return (
        f"speculative decoding: {spec.get('method')} with "
        f"{parsed.given.get('num_speculative_tokens', 0)} drafts a step (from --speculative-config)"
    )


def _default_reason(name: str) -> str:
    if name == "dtype":
        return "the model's (vLLM's auto)"
    if name == "quantization":
        return "none (the checkpoint's dense weights in dtype)"
    limit = ", or the model's limit if smaller" if name == "max_model_len" else ""
    return f"{BY_NAME[name].default}{limit} (vllm-aot default)"


def _given(flags: ShapeFlags, parsed: VllmFlags) -> dict[str, Any]:
    """The options the serve flags and vLLM's flags set; ValueError where both set one
    differently."""
    ours = flags.given()
    for name, value in ours.items():
        theirs = parsed.given.get(name)
        if theirs is not None and pinned_fields({name: value}, {}) != pinned_fields(
            {name: theirs}, {}
        ):
            raise ValueError(
                f"{BY_NAME[name].cli_flag} {value} contradicts {BY_NAME[name].vllm_flag} "
                f"{theirs}; give one"
            )
    return {**parsed.given, **ours}


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
    parsed = parse_vllm_flags(passthrough)
    config, passthrough = _merge_additional_config(
        dict(additional_config or {}), passthrough, parsed.additional_config
    )
    given = _given(flags, parsed)
    if manifest is not None:
        return _from_manifest(manifest, artifact_dir, given, flags, passthrough, config)
    ours = flags.given()
    shape_args: list[str] = []
    reasons: list[str] = []
    if registry_choice is not None:
        config = {**registry_choice.extra_fields, **config}
        reasons.append(registry_choice.why)
    for option in SHAPE_OPTIONS:
        name = option.name
        picked = registry_choice.runtime.get(name) if registry_choice else None
        picked = None if picked == "auto" else picked  # vLLM's default: nothing to pass
        if name in ours:
            shape_args += [option.vllm_flag, str(ours[name])]
            reasons.append(f"{name} = {ours[name]} (from {option.cli_flag})")
        elif name in given:
            reasons.append(f"{name} = {given[name]} (from {option.vllm_flag})")
        elif picked is not None:
            shape_args += [option.vllm_flag, str(picked)]
            reasons.append(f"{name} = {picked} (compiled configuration in the cache registry)")
        else:
            reasons.append(f"{name} = {_default_reason(name)}")
    shape_args += _tp_args(flags.tensor_parallel_size)
    reasons += [_tp_reason(flags.tensor_parallel_size), _speculative_reason(parsed)]
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
    given: dict[str, Any],
    flags: ShapeFlags,
    passthrough: tuple[str, ...],
    config: dict[str, Any],
) -> ChosenConfig:
    """The exported directory's shapes, checked as the platform checks them."""
    runtime = RuntimeConfig.from_dict(manifest["config"])
    asked = pinned_fields(given, {})
    if flags.tensor_parallel_size != 1:
        asked["tensor_parallel_size"] = flags.tensor_parallel_size
    check_artifact(artifact_dir, runtime, asked, config)
    where = f"exported directory {artifact_dir}" if artifact_dir else "exported directory"
    reasons = [f"{o.name} = {getattr(runtime, o.name)} (from the {where})" for o in SHAPE_OPTIONS]
    tp = runtime.tensor_parallel_size
    return ChosenConfig((*_tp_args(tp), *passthrough), config, (*reasons, _tp_reason(tp)))
