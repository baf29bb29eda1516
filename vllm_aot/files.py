"""Files written whole or not at all: staged beside the target, then renamed over it.

Every atomic write in vllm-aot goes through `staged_path`: the staging name is unique (pid and a
random part, so two threads or hosts never share one), hidden (a leading dot), keeps the target's
suffix (writers such as AOTInductor and the trace exporter choose a format by it), synced to disk
before the rename and the directory synced after it, so a reader sees the old file or the new one,
never half, even across a crash. `staged_dir` does the same for a whole directory (a built library,
a prepared model): filled under a hidden name, every file synced, renamed into place; the writers
of one directory take turns through `exclusive_lock`.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@contextmanager
def staged_path(target: Path) -> Iterator[Path]:
    """A fresh path beside `target` for the caller to write; renamed over `target` when the block
    exits normally, removed when it raises."""
    target = Path(target)
    staging = _staging_name(target)
    try:
        yield staging
        _fsync(staging)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    _fsync(target.parent)


@contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """A fresh, empty directory beside `target` for the caller to fill; when the block exits
    normally its files are synced and it is renamed to `target`, when it raises it is removed.

    An existing `target` is replaced: moved aside under a hidden name, then removed, so a reader
    sees the old directory, none, or the new one, never a mixture. Writers of one target must
    hold a lock between them (the second would otherwise replace the first's directory).
    """
    target = Path(target)
    staging = _staging_name(target)
    staging.mkdir()
    try:
        yield staging
        for path in staging.rglob("*"):
            if path.is_file() and not path.is_symlink():
                _fsync(path)
        _fsync(staging)
        if target.exists():
            doomed = _staging_name(target)
            os.rename(target, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _fsync(target.parent)


@contextmanager
def exclusive_lock(path: Path, *, what: str) -> Iterator[None]:
    """Hold an flock on `path` (created when missing), waiting for as long as another process
    holds it; `what` names the wait in the log line. The lock dies with its process, so a killed
    holder never blocks anyone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("vllm-aot: waiting for another process %s", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user may enter (mode 0700): made where missing, its mode
    tightened where it is ours; PermissionError where it is another user's or no directory."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user's")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def remove_staging_leftovers(target: Path) -> list[Path]:
    """Remove the staging files and directories that interrupted writes of `target` left beside
    it; returns them. Call only while holding the writers' lock (a live writer's would go too)."""
    target = Path(target)
    found = sorted(target.parent.glob(f".*-*.{glob.escape(target.name)}"))
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def _staging_name(target: Path) -> Path:
    """Unique (pid and a random part, so two threads or hosts never share one) and hidden."""
    return target.with_name(f".{os.getpid()}-{secrets.token_hex(4)}.{target.name}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as JSON at `path`, written whole or not at all."""
    with staged_path(path) as staging:
        staging.write_text(json.dumps(payload, indent=2, sort_keys=True))


def sync_directory(path: Path) -> None:
    """Make the renames done inside directory `path` survive a crash (fsync of the directory)."""
    _fsync(path)
