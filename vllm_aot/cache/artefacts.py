"""Start-up artefacts besides programs in the remote store: the kernels library and the prepared
bundled model, each a flat directory of files stored as `artefacts/<kind>/<digest>/<file>`.

`push_tree` uploads the files, then `manifest.json` (each file's sha256 and size): the manifest
marks the artefact complete. `fetch_tree` reads the manifest, refuses file names that are not
plain names (a path separator, `.` or `..`), copies every file into a staging directory beside the
target, checks each against the manifest and the whole with the caller's `accept`, and renames it
into place. Anything missing, corrupt or unreachable is a miss with one warning (the caller
builds or converts instead), never an error.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_aot.cache.remote import RemoteStore, get_json, put_json
from vllm_aot.files import file_sha256, staged_dir

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")


class UnusableArtefact(ValueError):
    """A remote artefact whose manifest or files are not what they claim to be."""


def artefact_name(kind: str, digest: str) -> str:
    """Where an artefact lives in a store (`kind`: kernels, models; `digest`: what it is)."""
    return f"artefacts/{kind}/{digest}"


def has_tree(store: RemoteStore, name: str) -> bool:
    """Whether `store` holds the complete artefact `name` (its manifest)."""
    return f"{name}/{MANIFEST}" in store.list(f"{name}/")


def push_tree(store: RemoteStore, name: str, source: Path, files: Sequence[str]) -> None:
    """Upload `files` of directory `source` as artefact `name`, the manifest last."""
    recorded = {}
    for file in files:
        path = Path(source) / _plain(file)
        store.put(f"{name}/{file}", path)
        recorded[file] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    manifest = {"files": recorded, "created": time.time(), "host": socket.gethostname()}
    put_json(store, f"{name}/{MANIFEST}", manifest)


def fetch_tree(
    store: RemoteStore,
    name: str,
    target: Path,
    accept: Callable[[Path], bool] = lambda directory: True,
) -> bool:
    """Install artefact `name` from `store` at directory `target` (replaced), verified and whole;
    False, with one warning when the store has something unusable, when it cannot."""
    try:
        manifest = get_json(store, f"{name}/{MANIFEST}")
        if manifest is None:
            return False
        files = _manifest_files(manifest)
        with staged_dir(target) as staging:
            for file, recorded in files.items():
                path = staging / file
                if not store.get(f"{name}/{file}", path):
                    raise UnusableArtefact(f"{file} is missing")
                found = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
                if found != {k: recorded[k] for k in found}:
                    raise UnusableArtefact(f"{file} does not match its recorded sha256")
            if not accept(staging):
                raise UnusableArtefact("its contents are not what this installation expects")
    except Exception as exc:  # a remote failure is a miss: the caller builds instead
        logger.warning(
            "vllm-aot cache: %s in %s is unusable (%s); ignoring it", name, store.url, exc
        )
        return False
    return True


def _plain(file: str) -> str:
    if not _PLAIN_NAME.fullmatch(file) or file in (".", ".."):
        raise UnusableArtefact(f"{file!r} is not a plain file name")
    return file


def _manifest_files(manifest: dict) -> dict[str, dict]:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise UnusableArtefact("its manifest lists no files")
    for file, recorded in files.items():
        _plain(file)
        if not isinstance(recorded, dict) or not {"sha256", "bytes"} <= recorded.keys():
            raise UnusableArtefact(f"its manifest entry for {file!r} is malformed")
    return files
