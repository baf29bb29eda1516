"""The registry of compiled configurations: which whole configurations the cache can serve.

One JSON record per configuration, filed under its architecture's digest (so fine-tunes of one
architecture share records): `registry/<arch digest>/<configuration digest>.json`, locally beside
the cache entries and in the remote store. A record lists the cache key of each of its programs;
it is written once every program is in the cache. Selection (`select_configuration`) keeps exact
matches on what the user asked for, then prefers the largest TP, then batch, then length that fits.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_aot.cache.keys import arch_digest, cpu_target, digest, versions
from vllm_aot.cache.remote import RemoteStore, get_json, put_json
from vllm_aot.files import write_json_atomic
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig

# Fields a user may pin when selecting (serve flags), with the registry field they compare to.
SELECTABLE = (
    "max_num_seqs",
    "max_model_len",
    "block_size",
    "max_num_batched_tokens",
    "dtype",
    "tensor_parallel_size",
)


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
        return self.tensor_parallel_size if name == "tensor_parallel_size" else self.runtime[name]

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
    def __init__(self, cache_root: str | Path, remote: RemoteStore | None = None) -> None:
        self.cache_root = Path(cache_root)
        self.root = self.cache_root / "registry"
        self.remote = remote

    def _object(self, entry: CompiledConfiguration) -> str:
        return f"registry/{entry.arch_digest}/{entry.name}.json"

    def has(self, entry: CompiledConfiguration) -> bool:
        """Whether the local registry already records `entry`'s configuration."""
        return (self.cache_root / self._object(entry)).is_file()

    def record(self, entry: CompiledConfiguration, *, push: bool = False) -> None:
        path = self.cache_root / self._object(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, entry.to_json())
        if push and self.remote is not None:
            put_json(self.remote, self._object(entry), entry.to_json())

    def local_entries(self, arch: str | None = None) -> list[CompiledConfiguration]:
        base = self.root / arch if arch else self.root
        if not base.is_dir():
            return []
        return [_load(json.loads(p.read_text()), "local") for p in sorted(base.rglob("*.json"))]

    def entries(self, arch: str) -> list[CompiledConfiguration]:
        """Local and remote records for one architecture digest (local first, deduplicated)."""
        found = {e.name: e for e in self.local_entries(arch)}
        if self.remote is not None:
            for name in self.remote.list(f"registry/{arch}/"):
                payload = get_json(self.remote, name)
                if payload is not None:
                    entry = _load(payload, self.remote.url)
                    found.setdefault(entry.name, entry)
        return sorted(found.values(), key=_preference, reverse=True)

    def push_all(self) -> int:
        if self.remote is None:
            return 0
        entries = self.local_entries()
        for entry in entries:
            put_json(self.remote, self._object(entry), entry.to_json())
        return len(entries)

    def pull_all(self) -> int:
        if self.remote is None:
            return 0
        names = self.remote.list("registry/")
        for name in names:
            payload = get_json(self.remote, name)
            if payload is not None:
                self.record(_load(payload, self.remote.url))
        return len(names)


def _load(payload: dict[str, Any], location: str) -> CompiledConfiguration:
    known = {k: v for k, v in payload.items() if k in CompiledConfiguration.__dataclass_fields__}
    return CompiledConfiguration(**{**known, "location": location})


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
    rows = [["batch", "max len", "block", "chunk", "dtype", "TP", "target", "versions", "where"]]
    for e in entries:
        r = e.runtime
        rows.append(
            [
                str(r["max_num_seqs"]),
                str(r["max_model_len"]),
                str(r["block_size"]),
                str(r["max_num_batched_tokens"]),
                r["dtype"],
                str(e.tensor_parallel_size),
                e.target,
                f"torch {e.torch}, vllm-aot {e.vllm_aot}"
                + (" (not loadable here)" if e.incompatibility else ""),
                e.location,
            ]
        )
    return rows
