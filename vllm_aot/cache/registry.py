"""The registry of compiled configurations: which whole configurations the cache can serve.

One JSON record per configuration, filed under its architecture's digest (so fine-tunes of one
architecture share records): `registry/<arch digest>/<configuration digest>.json`, locally beside
the cache entries and in the remote store. A record lists the cache key of each of its programs;
it is written once every program is in the cache. Selection (`select_configuration`) keeps exact
matches on what the user asked for, then prefers the largest TP, then batch, then length that fits.

A record read from disk or the store is parsed by `parse_record`, which refuses what is not one
(not JSON, missing or mistyped fields, shapes RuntimeConfig refuses, digests that are not hex): a
malformed record is skipped with a warning naming it, so one bad file never stops a selection.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import MISSING, Field, asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_aot.cache.keys import (
    ARCH_DIGEST_LENGTH,
    KEY_LENGTH,
    arch_digest,
    cpu_target,
    digest,
    versions,
)
from vllm_aot.cache.remote_tier import RemoteTier
from vllm_aot.cache.trust import is_hex_digest
from vllm_aot.files import write_json_atomic
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)

# Fields a user may pin when selecting (serve flags), with the registry field they compare to.
RUNTIME_SELECTABLE = (
    "max_num_seqs",
    "max_model_len",
    "block_size",
    "max_num_batched_tokens",
    "dtype",
)  # every record holds these
# Fields records written before they existed lack: their value there.
_LATER_FIELDS = {"quantization": "none", "kv_cache_dtype": "auto"}
SELECTABLE = (*RUNTIME_SELECTABLE, *_LATER_FIELDS, "tensor_parallel_size")


@dataclass(frozen=True)
class CompiledConfiguration:
    arch_digest: str
    architecture: str
    runtime: dict[str, Any]  # RuntimeConfig.shape_fields()
    target: str
    torch: str
    vllm_aot: str
    programs: dict[str, str] = field(default_factory=dict)  # program name -> cache key
    tensor_parallel_size: int = 1
    created: float = 0.0
    location: str = "local"  # where it was found (not stored)

    @classmethod
    def build(
        cls, arch: ModelArch, config: RuntimeConfig, programs: dict[str, str]
    ) -> CompiledConfiguration:
        return cls(
            arch_digest=arch_digest(arch),
            architecture=arch.architecture,
            runtime=config.shape_fields(),
            target=cpu_target(),
            programs=dict(sorted(programs.items())),
            created=time.time(),
            **versions(),
        )

    @property
    def name(self) -> str:
        """Digest of what makes it a distinct configuration (shapes, TP, target, versions)."""
        fields = (self.runtime, self.tensor_parallel_size, self.target, self.torch, self.vllm_aot)
        return digest(fields, 16)

    def value(self, name: str) -> Any:
        """A selectable field; quantization "none" for dense weights."""
        if name == "tensor_parallel_size":
            return self.tensor_parallel_size
        if name in _LATER_FIELDS:
            return self.runtime.get(name) or _LATER_FIELDS[name]
        return self.runtime[name]

    @property
    def incompatibility(self) -> str | None:
        """Why this machine cannot load it (other versions or ISA), or None."""
        here = {"target": cpu_target(), **versions()}
        there = {"target": self.target, "torch": self.torch, "vllm_aot": self.vllm_aot}
        wrong = [f"{k} {there[k]} (here {here[k]})" for k in here if there[k] != here[k]]
        return ", ".join(wrong) or None

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload.pop("location")
        return payload


class Registry:
    def __init__(self, cache_root: str | Path, remote: RemoteTier | None = None) -> None:
        self.cache_root = Path(cache_root)
        self.root = self.cache_root / "registry"
        self.remote = remote

    def _object(self, entry: CompiledConfiguration) -> str:
        return f"registry/{entry.arch_digest}/{entry.name}.json"

    def has(self, entry: CompiledConfiguration) -> bool:
        """Whether the local registry already records `entry`'s configuration."""
        return (self.cache_root / self._object(entry)).is_file()

    def record(self, entry: CompiledConfiguration, *, push: bool = False) -> None:
        """Write `entry` locally and, with `push`, to the remote store (a failed upload is the
        remote tier's warning, not an error)."""
        path = self.cache_root / self._object(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, entry.to_json())
        if push and self.remote is not None:
            self.remote.put_record(self._object(entry), entry.to_json())

    def local_entries(self, arch: str | None = None) -> list[CompiledConfiguration]:
        """The well-formed local records (of one architecture digest, or all)."""
        return [entry for _, entry in self._scan_local(arch) if entry is not None]

    def malformed_local(self) -> list[Path]:
        """Local record files that are not records (`cache cleanup` removes them)."""
        return [path for path, entry in self._scan_local(None) if entry is None]

    def _scan_local(self, arch: str | None) -> list[tuple[Path, CompiledConfiguration | None]]:
        base = self.root / arch if arch else self.root
        if not base.is_dir():
            return []
        found = []
        for path in sorted(base.rglob("*.json")):
            try:
                found.append((path, parse_record(json.loads(path.read_bytes()), "local")))
            except (OSError, ValueError) as exc:
                logger.warning("vllm-aot cache: skipping registry record %s: %s", path, exc)
                found.append((path, None))
        return found

    def _remote_entries(self, prefix: str) -> list[CompiledConfiguration]:
        if self.remote is None:
            return []
        found = []
        for name, payload in self.remote.records(prefix):
            try:
                found.append(parse_record(payload, self.remote.url))
            except ValueError as exc:
                logger.warning(
                    "vllm-aot cache: skipping registry record %s from %s: %s",
                    name,
                    self.remote.url,
                    exc,
                )
        return found

    def entries(self, arch: str) -> list[CompiledConfiguration]:
        """Local and remote records for one architecture digest (local first, deduplicated)."""
        found = {e.name: e for e in self.local_entries(arch)}
        for entry in self._remote_entries(f"registry/{arch}/"):
            found.setdefault(entry.name, entry)
        return sorted(found.values(), key=_preference, reverse=True)

    def push_all(self) -> int:
        """Upload every local record; how many were stored."""
        if self.remote is None:
            return 0
        return sum(
            self.remote.put_record(self._object(entry), entry.to_json())
            for entry in self.local_entries()
        )

    def pull_all(self) -> int:
        """Record every well-formed remote record locally; how many."""
        entries = self._remote_entries("registry/")
        for entry in entries:
            self.record(entry)
        return len(entries)


def parse_record(payload: Any, location: str) -> CompiledConfiguration:
    """A registry record as a CompiledConfiguration found at `location`; ValueError naming what
    makes it no record."""
    if not isinstance(payload, dict):
        raise ValueError("not a JSON object")
    fields = CompiledConfiguration.__dataclass_fields__
    known = {k: v for k, v in payload.items() if k in fields and k != "location"}
    missing = [name for name, f in fields.items() if _is_required(f) and name not in known]
    if missing:
        raise ValueError(f"missing {missing}")
    entry = CompiledConfiguration(**known, location=location)
    if not is_hex_digest(entry.arch_digest, ARCH_DIGEST_LENGTH):
        raise ValueError(f"arch_digest {entry.arch_digest!r} is not a hex digest")
    texts = (entry.architecture, entry.target, entry.torch, entry.vllm_aot)
    if not all(isinstance(text, str) for text in texts):
        raise ValueError("architecture, target, torch and vllm_aot must be strings")
    if not isinstance(entry.tensor_parallel_size, int) or entry.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size {entry.tensor_parallel_size!r}")
    if not isinstance(entry.created, (int, float)):
        raise ValueError(f"created {entry.created!r} is not a time")
    programs = entry.programs
    if not isinstance(programs, dict) or not all(
        isinstance(name, str) and is_hex_digest(key, KEY_LENGTH) for name, key in programs.items()
    ):
        raise ValueError("programs must map program names to cache keys")
    runtime = entry.runtime
    if not isinstance(runtime, dict) or not set(RUNTIME_SELECTABLE) <= set(runtime):
        raise ValueError(f"runtime must hold {list(RUNTIME_SELECTABLE)}")
    try:
        RuntimeConfig.from_dict(runtime)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"runtime {runtime}: {exc}") from None
    return entry


def _is_required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _preference(entry: CompiledConfiguration) -> tuple[int, int, int, float]:
    """Largest TP, batch, length; among equals (they differ in buckets) the newest compiled."""
    runtime = entry.runtime
    return (
        entry.tensor_parallel_size,
        runtime["max_num_seqs"],
        runtime["max_model_len"],
        entry.created,
    )


def select_configuration(
    entries: list[CompiledConfiguration], requested: dict[str, Any], *, num_cores: int
) -> tuple[CompiledConfiguration | None, str]:
    """The configuration to serve, and why: exact matches on every field in `requested`, loadable
    here, TP within `num_cores`; then the largest TP, then batch, then length, then the newest."""
    pinned = {k: v for k, v in requested.items() if v is not None}
    unknown = set(pinned) - set(SELECTABLE)
    if unknown:
        raise ValueError(f"cannot select on {sorted(unknown)}; selectable: {list(SELECTABLE)}")
    usable = [e for e in entries if e.incompatibility is None]
    matching = [e for e in usable if all(e.value(k) == v for k, v in pinned.items())]
    fitting = [e for e in matching if e.tensor_parallel_size <= num_cores]
    if not fitting:
        why = (
            f"none of {len(entries)} cached configurations "
            f"({len(usable)} loadable here, {len(matching)} matching {pinned or 'anything'}) "
            f"fits {num_cores} cores"
        )
        return None, why
    best = max(fitting, key=_preference)
    open_fields = [k for k in SELECTABLE if k not in pinned]
    return best, (
        f"cached configuration {best.name} ({best.location}): exact match on "
        f"{', '.join(f'{k}={v}' for k, v in pinned.items()) or 'nothing requested'}; "
        f"{len(fitting)} candidates, largest TP, then batch, then length, then newest chosen for "
        f"{', '.join(open_fields)}"
    )


def describe_rows(entries: list[CompiledConfiguration]) -> list[list[str]]:
    """Header + one row per configuration, for `vllm-aot cache lookup` and error messages."""
    rows = [["batch", "max len", "block", "chunk", "dtype", "weights", "KV", "TP", "target"]]
    rows[0] += ["versions", "where"]
    for e in entries:
        r = e.runtime
        rows.append(
            [
                str(r["max_num_seqs"]),
                str(r["max_model_len"]),
                str(r["block_size"]),
                str(r["max_num_batched_tokens"]),
                r["dtype"],
                RuntimeConfig.from_dict(r).formats_summary(),
                e.value("kv_cache_dtype"),
                str(e.tensor_parallel_size),
                e.target,
                f"torch {e.torch}, vllm-aot {e.vllm_aot}"
                + (" (not loadable here)" if e.incompatibility else ""),
                e.location,
            ]
        )
    return rows
