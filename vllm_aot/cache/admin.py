"""Cache housekeeping: status, cleanup and sync with the remote store (what `vllm-aot cache` runs).

Each function returns plain data; the CLI prints it.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vllm_aot.cache.keys import cpu_target, versions
from vllm_aot.cache.local import LocalCache
from vllm_aot.cache.program_cache import ProgramCache


@dataclass(frozen=True)
class LockState:
    key: str
    held: bool
    owner: str  # "pid N on HOST (for S s)" or "unknown"


@dataclass
class CacheStatus:
    root: Path
    num_entries: int = 0
    total_bytes: int = 0
    versions: Counter = field(default_factory=Counter)  # "torch X, vllm-aot Y, target Z" -> n
    failed: list[dict] = field(default_factory=list)
    locks: list[LockState] = field(default_factory=list)
    abandoned: list[Path] = field(default_factory=list)
    configurations: int = 0
    remote_url: str | None = None
    remote_entries: int | None = None
    remote_failure: str | None = None  # why the remote store could not be read
    is_signing: bool = False  # uploads signed, unsigned remote objects refused
    is_read_only: bool = False


def _entry_version(meta: dict) -> str:
    fp = meta.get("fingerprint", {})
    return f"torch {fp.get('torch')}, vllm-aot {fp.get('vllm_aot')}, target {fp.get('target')}"


def current_version() -> str:
    v = versions()
    return f"torch {v['torch']}, vllm-aot {v['vllm_aot']}, target {cpu_target()}"


def status(cache: ProgramCache) -> CacheStatus:
    local = cache.local
    result = CacheStatus(root=local.root, remote_url=cache.remote.url if cache.remote else None)
    for key in local.entry_keys():
        meta = local.read_meta(key) or {}
        result.num_entries += 1
        result.total_bytes += int(meta.get("bytes", 0))
        result.versions[_entry_version(meta)] += 1
    result.failed = local.failures()
    for key in local.lock_keys():
        owner = local.lock_owner(key)
        described = owner.describe() if owner else "unknown"
        result.locks.append(LockState(key, local.is_locked(key), described))
    result.abandoned = local.abandoned_staging()
    result.configurations = len(cache.registry.local_entries())
    if cache.remote is not None:
        result.remote_entries = len(cache.remote.entry_keys())
        result.remote_failure = cache.remote.failure
        result.is_signing = cache.remote.trust.is_signing
        result.is_read_only = cache.remote.read_only
    return result


def cleanup(cache: ProgramCache, *, dry_run: bool) -> list[str]:
    """Remove failed records, stale locks, abandoned staging directories, entries and registry
    records of other versions/targets. Returns what it removed (or would)."""
    local: LocalCache = cache.local
    here = current_version()
    doomed: list[tuple[str, Path]] = []
    for failure in local.failures():
        record = local.failed_dir / f"{failure['key']}.json"
        doomed.append((f"failed record of {failure['name']}", record))
    doomed += [(f"abandoned staging {p.name}", p) for p in local.abandoned_staging()]
    for key in local.entry_keys():
        meta = local.read_meta(key)
        if meta is None or _entry_version(meta) != here:
            version = _entry_version(meta) if meta else "unreadable"
            doomed.append((f"entry {key} ({version})", local.entry_dir(key)))
    for entry in cache.registry.local_entries():
        if entry.incompatibility:
            path = cache.registry.root / entry.arch_digest / f"{entry.name}.json"
            doomed.append((f"configuration {entry.name} ({entry.incompatibility})", path))
    doomed += [(f"malformed registry record {p}", p) for p in cache.registry.malformed_local()]
    # A lock is removed only while this process holds it: a compiler may take it at any time.
    stale = [key for key in local.lock_keys() if not local.is_locked(key)]
    done = [f"stale lock {key}" for key in stale if dry_run or local.remove_free_lock(key)]
    for what, path in doomed:
        if not path.exists():
            continue
        done.append(what)
        if dry_run:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return done


def sync(
    cache: ProgramCache, *, push: bool, pull: bool, overwrite: bool = False
) -> tuple[int, int]:
    """Copy entries and registry records the other side lacks (`overwrite`: push every local
    entry, replacing the store's copy, e.g. to sign it with a new key); returns (pushed, pulled).

    Entries pulled are verified like any fetch (a refused one is a warning, not counted). Raises
    ValueError without a remote store or when pushing to a read-only one, RuntimeError when the
    store failed (its reason)."""
    remote_tier = cache.remote
    if remote_tier is None:
        raise ValueError(
            "no remote store configured: pass --remote URL or set VLLM_AOT_REMOTE_CACHE"
        )
    if push and remote_tier.read_only:
        raise ValueError("the remote store is read-only (VLLM_AOT_CACHE_READ_ONLY): cannot push")
    remote = remote_tier.entry_keys()
    local = set(cache.local.entry_keys())
    pushed = pulled = 0
    if push:
        for key in sorted(local if overwrite else local - remote):
            pushed += remote_tier.push_entry(key, cache.local)
        cache.registry.push_all()
    if pull:
        for key in sorted(remote - local):
            with cache.local.lock(key, timeout=cache.settings.lock_timeout):
                pulled += remote_tier.fetch_entry(key, cache.local) is not None
        cache.registry.pull_all()
    if remote_tier.failure is not None:
        raise RuntimeError(
            f"remote store {remote_tier.url} failed after {pushed} pushed and {pulled} pulled: "
            f"{remote_tier.failure}"
        )
    return pushed, pulled
