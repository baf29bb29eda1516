"""Files written whole or not at all: staged beside the target, then renamed over it.

Every atomic write in vllm-aot goes through `staged_path`: the staging name is unique (pid and a
random part, so two threads or hosts never share one), hidden (a leading dot), keeps the target's
suffix (writers such as AOTInductor and the trace exporter choose a format by it), synced to disk
before the rename and the directory synced after it, so a reader sees the old file or the new one,
never half, even across a crash.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def staged_path(target: Path) -> Iterator[Path]:
    """A fresh path beside `target` for the caller to write; renamed over `target` when the block
    exits normally, removed when it raises."""
    target = Path(target)
    staging = target.with_name(f".{os.getpid()}-{secrets.token_hex(4)}.{target.name}")
    try:
        yield staging
        _fsync(staging)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    _fsync(target.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: Any) -> None:
    """`payload` as JSON at `path`, written whole or not at all."""
    with staged_path(path) as staging:
        staging.write_text(json.dumps(payload, indent=2, sort_keys=True))


def sync_directory(path: Path) -> None:
    """Make the renames done inside directory `path` survive a crash (fsync of the directory)."""
    _fsync(path)
