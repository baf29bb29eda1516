"""The local tier of the compile cache: content-addressed entries, per-key locks, failure records.

Layout under the cache root (default `~/.cache/vllm-aot/compiled`):

    entries/<key>/program.pt2, meta.json   complete entries; meta.json holds the sha256 and size
    entries/.staging-<key>-<pid>-<random>/  an entry being written; renamed into place when whole
    locks/<key>.lock, <key>.owner          flock held while one process compiles the key; the
                                           owner file says who (pid, host, since when)
    failed/<key>.json                      the last failed compile of a key (never blocks a retry)

Readers never lock: an entry exists only once its directory was renamed into place, and it is
verified against its recorded digest before use; a mismatch removes it (it will be rebuilt).
A lock dies with its process (flock), so a crashed compiler never blocks anyone; its owner file
and staging directory are left for `cleanup` (and are removed by the next owner of the key).
`cleanup` removes a lock file only while holding its lock, and a lock counts only on the file its
path names now (`try_lock` takes the new file when the one it opened was removed meanwhile), so
two compilers never hold one key.
Keys become directory and file names only when they are hex digests (ValueError otherwise), and
a committed entry's rename is synced to disk with its directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_aot.cache.keys import KEY_LENGTH
from vllm_aot.cache.trust import is_hex_digest
from vllm_aot.files import file_sha256, sync_directory, write_json_atomic

logger = logging.getLogger(__name__)

PROGRAM_FILE = "program.pt2"
META_FILE = "meta.json"
OWNER_FILE = "owner.json"


class CacheLockTimeout(TimeoutError):
    """Another process held a key's lock for longer than we were willing to wait."""


def checked_key(key: str) -> str:
    """`key`, once it is known to be a cache key (a hex digest), before it names a path."""
    if not is_hex_digest(key, KEY_LENGTH):
        raise ValueError(f"{key!r} is not a cache key ({KEY_LENGTH} hex digits)")
    return key


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    since: float

    @classmethod
    def me(cls) -> LockOwner:
        return cls(pid=os.getpid(), host=socket.gethostname(), since=time.time())

    @property
    def is_dead(self) -> bool:
        """Known dead: a process of this host that no longer exists."""
        return self.host == socket.gethostname() and not pid_alive(self.pid)

    def describe(self) -> str:
        age = time.time() - self.since
        return f"pid {self.pid} on {self.host} (for {age:.0f} s)"


def _is_file_at(handle, path: Path) -> bool:
    """Whether the open `handle` is the file `path` names now."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


class LocalCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.entries_dir = self.root / "entries"
        self.locks_dir = self.root / "locks"
        self.failed_dir = self.root / "failed"

    # -- entries -----------------------------------------------------------------------------

    def entry_dir(self, key: str) -> Path:
        return self.entries_dir / checked_key(key)

    def lookup(self, key: str) -> Path | None:
        """The verified program file of `key`, or None. A corrupted entry is removed."""
        entry = self.entry_dir(key)
        meta_path = entry / META_FILE
        if not meta_path.is_file():
            return None
        program = entry / PROGRAM_FILE
        try:
            meta = json.loads(meta_path.read_text())
            intact = program.stat().st_size == meta["bytes"]
            intact = intact and file_sha256(program) == meta["sha256"]
        except (OSError, ValueError, KeyError):
            intact = False
        if intact:
            return program
        logger.warning("vllm-aot cache: entry %s is corrupted; removing it to rebuild", key)
        self.remove_entry(key)
        return None

    def read_meta(self, key: str) -> dict[str, Any] | None:
        try:
            meta = json.loads((self.entry_dir(key) / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def staging_dir(self, key: str) -> Path:
        """A fresh, private directory to build `key`'s entry in (see `commit`); unique even among
        threads of one process and hosts sharing the cache."""
        path = self._private_name("staging", checked_key(key))
        path.mkdir(parents=True)
        write_json_atomic(path / OWNER_FILE, LockOwner.me().__dict__)
        return path

    def commit(self, key: str, staging: Path, meta: dict[str, Any]) -> Path:
        """Seal a staged entry (its program file must be whole) and rename it into place."""
        program = staging / PROGRAM_FILE
        meta = {
            **meta,
            "key": key,
            "sha256": file_sha256(program),
            "bytes": program.stat().st_size,
            "created": time.time(),
            "host": socket.gethostname(),
        }
        write_json_atomic(staging / META_FILE, meta)
        (staging / OWNER_FILE).unlink(missing_ok=True)
        target = self.entry_dir(key)
        try:
            os.rename(staging, target)
        except OSError:  # someone committed it first (or a corrupt copy is in the way)
            if self.lookup(key) is None:
                os.rename(staging, target)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        sync_directory(self.entries_dir)
        self.clear_failure(key)
        return target / PROGRAM_FILE

    def remove_entry(self, key: str) -> None:
        entry = self.entry_dir(key)
        if not entry.exists():
            return
        doomed = self._private_name("removing", key)
        with contextlib.suppress(OSError):
            os.rename(entry, doomed)  # readers stop seeing it at once
            shutil.rmtree(doomed, ignore_errors=True)

    def _private_name(self, purpose: str, key: str) -> Path:
        """A hidden name in entries/ that no other thread, process or host uses."""
        return self.entries_dir / f".{purpose}-{key}-{os.getpid()}-{secrets.token_hex(4)}"

    def entry_keys(self) -> list[str]:
        if not self.entries_dir.is_dir():
            return []
        return sorted(
            p.name for p in self.entries_dir.iterdir() if is_hex_digest(p.name, KEY_LENGTH)
        )

    def abandoned_staging(self, key: str = "") -> list[Path]:
        """Staging directories (of `key`, or all) whose writer is dead, and half-removed entries."""
        if not self.entries_dir.is_dir():
            return []
        found = []
        for path in self.entries_dir.glob(f".*-{key}*" if key else ".*"):
            if path.name.startswith(".removing-"):
                found.append(path)
                continue
            try:
                owner = LockOwner(**json.loads((path / OWNER_FILE).read_text()))
            except (OSError, ValueError, TypeError):
                owner = None
            if owner is None or owner.is_dead:
                found.append(path)
        return found

    # -- locks -------------------------------------------------------------------------------

    def lock_path(self, key: str) -> Path:
        return self.locks_dir / f"{key}.lock"

    def lock_keys(self) -> list[str]:
        """Keys with a lock file (held now or left behind)."""
        return (
            sorted(p.stem for p in self.locks_dir.glob("*.lock")) if self.locks_dir.is_dir() else []
        )

    def lock_owner(self, key: str) -> LockOwner | None:
        try:
            return LockOwner(**json.loads(self.lock_path(key).with_suffix(".owner").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def is_locked(self, key: str) -> bool:
        """Whether some process holds `key`'s lock right now (without taking it)."""
        path = self.lock_path(key)
        if not path.exists():
            return False
        with open(path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    @contextlib.contextmanager
    def lock(self, key: str, *, timeout: float) -> Iterator[None]:
        """Hold `key`'s lock; wait up to `timeout` s (0: try once) else raise CacheLockTimeout."""
        handle = self.try_lock(key, timeout=timeout)
        try:
            yield
        finally:
            self.unlock(key, handle)

    def try_lock(self, key: str, *, timeout: float):
        """Take `key`'s lock and return its handle (for `unlock`); CacheLockTimeout otherwise."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        path = self.lock_path(checked_key(key))
        handle = open(path, "a")  # noqa: SIM115 - lives as long as the lock
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _is_file_at(handle, path):
                    break
                handle.close()  # removed by `cleanup` since it was opened: take the new file
                handle = open(path, "a")  # noqa: SIM115
                continue
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.close()
                    owner = self.lock_owner(key)
                    raise CacheLockTimeout(
                        f"waited {timeout:.0f} s for compiled program {key}, which "
                        f"{owner.describe() if owner else 'another process'} is building; "
                        f"raise VLLM_AOT_CACHE_LOCK_TIMEOUT, or remove {path} if that process "
                        "is gone"
                    ) from None
                time.sleep(0.2)
        previous = self.lock_owner(key)
        if previous is not None and previous.is_dead:
            logger.info(
                "vllm-aot cache: %s was left locked by dead %s; taking it over",
                key,
                previous.describe(),
            )
        write_json_atomic(path.with_suffix(".owner"), LockOwner.me().__dict__)
        for abandoned in self.abandoned_staging(key):
            shutil.rmtree(abandoned, ignore_errors=True)
        return handle

    def unlock(self, key: str, handle) -> None:
        self.lock_path(key).with_suffix(".owner").unlink(missing_ok=True)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    def remove_free_lock(self, key: str) -> bool:
        """Remove `key`'s lock and owner files, holding the lock while they go; False (nothing
        removed) when another process holds it or there is none."""
        path = self.lock_path(key)
        try:
            handle = open(path, "rb")  # noqa: SIM115 - never creates one
        except FileNotFoundError:
            return False
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if not _is_file_at(handle, path):
                return False
            path.with_suffix(".owner").unlink(missing_ok=True)
            path.unlink()
            return True

    # -- failures ----------------------------------------------------------------------------

    def record_failure(self, key: str, name: str, error: str) -> None:
        self.failed_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "key": key,
            "name": name,
            "error": error[-4000:],
            "time": time.time(),
            "host": socket.gethostname(),
        }
        write_json_atomic(self.failed_dir / f"{checked_key(key)}.json", payload)

    def failure(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.failed_dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def failures(self) -> list[dict[str, Any]]:
        if not self.failed_dir.is_dir():
            return []
        return [f for p in sorted(self.failed_dir.glob("*.json")) if (f := self.failure(p.stem))]

    def clear_failure(self, key: str) -> None:
        (self.failed_dir / f"{key}.json").unlink(missing_ok=True)
