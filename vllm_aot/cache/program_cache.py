"""ProgramCache: every program of a configuration, from the cheapest place that has it.

Order per program: the local cache without a lock; then its lock, the local cache again (another
process may just have finished it), the remote store, and finally a compile, if allowed. Keys whose
lock another process holds are left for last and waited for (with a timeout), so two processes
starting together split the work and neither compiles a program twice. Each compiled program is
committed (and uploaded, when configured) as soon as it is done, so an interrupted start keeps
what it finished. When the whole configuration is present it is recorded in the registry.

The remote store is a `RemoteTier`: what it fails to give (unreachable, slow, refused) is a miss
and what it fails to take is a warning, so a remote store never stops a start that the local cache
or the compiler can serve.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_aot import paths
from vllm_aot.cache.keys import arch_digest, program_cache_key, program_fingerprint
from vllm_aot.cache.local import PROGRAM_FILE, CacheLockTimeout, LocalCache
from vllm_aot.cache.registry import CompiledConfiguration, Registry, describe_rows
from vllm_aot.cache.remote import RemoteStore, open_store
from vllm_aot.cache.remote_tier import RemoteTier
from vllm_aot.cache.trust import Trust, signing_key
from vllm_aot.models.config import ModelArch
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, all_program_keys

logger = logging.getLogger(__name__)

# compile_fn(jobs, on_done): build each (program, output path) and call on_done(program, seconds)
# as each finishes; raise if any fails.
CompileFn = Callable[[list[tuple[ProgramKey, Path]], Callable[[ProgramKey, float], None]], None]
# on_event(program name, source, seconds) with source "local" | "remote" | "compiled".
EventFn = Callable[[str, str, float], None]


class CacheDiskFullError(RuntimeError):
    """The compile cache's device has no space left for the programs being compiled."""


class CacheMissError(RuntimeError):
    """Programs are missing and compiling is not allowed here."""


@dataclass(frozen=True)
class CacheSettings:
    root: Path
    remote_url: str | None = None
    upload: bool = False  # push every program this process compiles to the remote store
    read_only: bool = False  # never write to the remote store (serving fleets)
    # HMAC key: uploads are signed, remote objects without its signature refused (trust.py)
    signing_key: bytes | None = field(default=None, repr=False)
    remote_timeout: float = 30.0  # seconds a remote call may take (plus 1 s per MB of payload)
    lock_timeout: float = 1800.0  # seconds to wait for a program another process compiles

    def __post_init__(self) -> None:
        if self.upload and self.read_only:
            raise ValueError(
                "uploads are asked for (--cache-upload or VLLM_AOT_CACHE_UPLOAD) but the remote "
                "store is read-only (VLLM_AOT_CACHE_READ_ONLY); give one"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> CacheSettings:
        """VLLM_AOT_REMOTE_CACHE (URL), VLLM_AOT_CACHE_UPLOAD=1, VLLM_AOT_CACHE_READ_ONLY=1,
        VLLM_AOT_CACHE_SIGNING_KEY (or _FILE, a file holding it), VLLM_AOT_REMOTE_TIMEOUT (s),
        VLLM_AOT_CACHE_LOCK_TIMEOUT (s); explicit `overrides` (not None) win."""
        env = os.environ.get
        settings = {
            "root": paths.compiled_cache_dir(),
            "remote_url": env("VLLM_AOT_REMOTE_CACHE") or None,
            "upload": env("VLLM_AOT_CACHE_UPLOAD", "") not in ("", "0", "false"),
            "read_only": env("VLLM_AOT_CACHE_READ_ONLY", "") not in ("", "0", "false"),
            "signing_key": signing_key(
                env("VLLM_AOT_CACHE_SIGNING_KEY"), env("VLLM_AOT_CACHE_SIGNING_KEY_FILE")
            ),
            "remote_timeout": float(env("VLLM_AOT_REMOTE_TIMEOUT", 30)),
            "lock_timeout": float(env("VLLM_AOT_CACHE_LOCK_TIMEOUT", 1800)),
        }
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{**settings, "root": Path(settings["root"])})


@dataclass
class CacheOutcome:
    """Where each program came from: the paths to load, sources and seconds per program name."""

    paths: dict[ProgramKey, Path] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def names(self, source: str) -> list[str]:
        return sorted(name for name, s in self.sources.items() if s == source)

    def add(self, key: ProgramKey, path: Path, source: str, seconds: float) -> None:
        self.paths[key] = path
        self.sources[key.name] = source
        self.seconds[key.name] = seconds


class ProgramCache:
    def __init__(self, settings: CacheSettings, *, store: RemoteStore | None = None) -> None:
        """`store`: the remote store itself, instead of the one `settings.remote_url` names."""
        self.settings = settings
        self.local = LocalCache(settings.root)
        if store is None and settings.remote_url:
            store = open_store(settings.remote_url, timeout=settings.remote_timeout)
        self.remote = None
        if store is not None:
            self.remote = RemoteTier(
                store,
                trust=Trust(settings.signing_key),
                read_only=settings.read_only,
                timeout=settings.remote_timeout,
            )
        self.registry = Registry(settings.root, self.remote)

    def ensure(
        self,
        arch: ModelArch,
        config: RuntimeConfig,
        *,
        compile_fn: CompileFn | None,
        on_event: EventFn = lambda name, source, seconds: None,
    ) -> CacheOutcome:
        """Every program of `config`; compiles the missing ones with `compile_fn` (None: refuse,
        raising CacheMissError that lists the cached configurations of this architecture)."""
        keys = {pk: program_cache_key(arch, config, pk) for pk in all_program_keys(config)}
        outcome = CacheOutcome()

        def add(pk: ProgramKey, path: Path, source: str, seconds: float) -> None:
            outcome.add(pk, path, source, seconds)
            on_event(pk.name, source, seconds)

        for pk, key in keys.items():
            start = time.perf_counter()
            if (path := self.local.lookup(key)) is not None:
                add(pk, path, "local", time.perf_counter() - start)
        pending = [pk for pk in keys if pk not in outcome.paths]
        wait = 0.0  # first pass: take free locks only; then wait for the ones others hold
        while pending:
            locked, blocked = self._lock_all(pending, keys, wait)
            try:
                to_build = self._fetch(locked, keys, add)
                if to_build and compile_fn is None:
                    raise CacheMissError(self.miss_message(arch, to_build))
                if to_build:
                    self._compile(arch, config, to_build, keys, locked, compile_fn, add)
            finally:
                for pk, handle in locked.items():
                    self.local.unlock(keys[pk], handle)
            pending, wait = blocked, self.settings.lock_timeout
            if pending:
                logger.info(
                    "vllm-aot cache: waiting for %d programs other processes are compiling",
                    len(pending),
                )
        entry = CompiledConfiguration.build(arch, config, {pk.name: k for pk, k in keys.items()})
        if not self.registry.has(entry):  # a warm start writes (and uploads) nothing
            self.registry.record(entry, push=self.settings.upload)
        return outcome

    def _lock_all(self, pending, keys, wait: float):
        locked, blocked = {}, []
        for pk in pending:
            try:
                locked[pk] = self.local.try_lock(keys[pk], timeout=wait)
            except CacheLockTimeout:
                if wait > 0:
                    for k, handle in locked.items():
                        self.local.unlock(keys[k], handle)
                    raise
                blocked.append(pk)
        return locked, blocked

    def _fetch(self, locked, keys, add) -> list[ProgramKey]:
        """`add` what the local cache (again) or the remote store has; return the rest."""
        to_build = []
        for pk in locked:
            start = time.perf_counter()
            if (path := self.local.lookup(keys[pk])) is not None:
                add(pk, path, "local", time.perf_counter() - start)
            elif self.remote is not None and (
                path := self.remote.fetch_entry(keys[pk], self.local)
            ):
                add(pk, path, "remote", time.perf_counter() - start)
            else:
                to_build.append(pk)
        return to_build

    def _compile(self, arch, config, to_build, keys, locked, compile_fn, add) -> None:
        staging = {pk: self.local.staging_dir(keys[pk]) for pk in to_build}
        for pk in to_build:
            if failure := self.local.failure(keys[pk]):
                logger.warning(
                    "vllm-aot cache: %s failed to compile before (%s); retrying",
                    pk.name,
                    time.ctime(failure["time"]),
                )

        def on_done(pk: ProgramKey, seconds: float) -> None:
            meta = {
                "name": pk.name,
                "compile_seconds": round(seconds, 3),
                "fingerprint": program_fingerprint(arch, config, pk),
            }
            path = self.local.commit(keys[pk], staging[pk], meta)
            add(pk, path, "compiled", seconds)
            if self.settings.upload and self.remote is not None:
                self.remote.push_entry(keys[pk], self.local)  # a failure is its warning
            self.local.unlock(keys[pk], locked.pop(pk))

        try:
            compile_fn([(pk, staging[pk] / PROGRAM_FILE) for pk in to_build], on_done)
            if unreported := sorted(pk.name for pk in to_build if pk in locked):
                raise RuntimeError(
                    f"compiling ended without committing {', '.join(unreported)}: the compiler "
                    "did not report them, or committing them failed (see the error above)"
                )
        except BaseException as exc:
            unbuilt = [pk for pk in to_build if pk in locked]  # not committed
            self._record_failures(unbuilt, keys, traceback.format_exc())
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise CacheDiskFullError(
                    f"no space left on the device of the compile cache {self.local.root}: "
                    f"{len(unbuilt)} programs were not compiled ({unbuilt[0].name}, ...); the "
                    "ones already committed are whole. Free space there, or point "
                    "VLLM_AOT_COMPILE_CACHE at a device with room, and start again."
                ) from exc
            raise
        finally:
            for pk in to_build:
                if pk in locked:
                    shutil.rmtree(staging[pk], ignore_errors=True)

    def _record_failures(self, unbuilt: list[ProgramKey], keys, error: str) -> None:
        """Remember why `unbuilt` failed; a record that cannot be written (a full disk) is only
        logged, so the compile's own error is the one raised."""
        for pk in unbuilt:
            try:
                self.local.record_failure(keys[pk], pk.name, error)
            except OSError as exc:
                logger.warning("vllm-aot cache: cannot record %s's failure: %s", pk.name, exc)

    def missing(self, arch: ModelArch, config: RuntimeConfig) -> list[ProgramKey]:
        """Programs of `config` neither in the local cache nor in the remote store (no locks)."""
        keys = {pk: program_cache_key(arch, config, pk) for pk in all_program_keys(config)}
        absent = [pk for pk, key in keys.items() if self.local.lookup(key) is None]
        if absent and self.remote is not None:
            remote = self.remote.entry_keys()
            absent = [pk for pk in absent if keys[pk] not in remote]
        return absent

    def miss_message(self, arch: ModelArch, missing: list[ProgramKey]) -> str:
        names = sorted(pk.name for pk in missing)
        lines = [
            f"{len(names)} compiled programs of this configuration are not cached "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) and compiling is not "
            f"allowed (--require-cached). Fill the cache with `vllm-aot export --compile-only` "
            f"(same flags) or serve one of the cached configurations."
        ]
        entries = self.registry.entries(arch_digest(arch))
        if not entries:
            lines.append(
                f"No configuration of this architecture is cached in {self.local.root}"
                + (f" or {self.remote.url}" if self.remote else "")
                + "."
            )
        else:
            lines.append("Cached configurations of this architecture:")
            lines += ["  " + " | ".join(row) for row in describe_rows(entries)]
        return "\n".join(lines)
