"""Start-up artefacts besides programs in the remote store: the kernels library and the prepared
bundled model, each a flat directory of files stored as `artefacts/<kind>/<digest>/<file>`.

Every file goes through the remote tier like a program (`RemoteTier.push_object` /
`fetch_object`: signed when the deployment has a signing key, verified against its recorded sha256
and size before it lands, read-only and failing stores respected). `push_tree` uploads the files,
then `manifest.json` listing them: the manifest marks the artefact complete. `fetch_tree` reads the
manifest, refuses file names that are not plain names (a path separator, `.` or `..`), fetches
every file into a staging directory beside the target, checks the whole with the caller's
`accept`, and renames it into place. Anything missing, corrupt, unsigned or unreachable is a miss
with one warning (the caller builds or converts instead), never an error.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_aot.cache.remote_tier import RemoteTier
from vllm_aot.files import staged_dir

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")


class UnusableArtefact(ValueError):
    """A remote artefact whose manifest or files are not what they claim to be."""


def artefact_name(kind: str, digest: str) -> str:
    """Where an artefact lives in a store (`kind`: kernels, models; `digest`: what it is)."""
    return f"artefacts/{kind}/{digest}"


def has_tree(remote: RemoteTier, name: str) -> bool:
    """Whether the store holds the complete artefact `name` (its manifest)."""
    return f"{name}/{MANIFEST}" in remote.list(f"{name}/")


def push_tree(remote: RemoteTier, name: str, source: Path, files: Sequence[str]) -> bool:
    """Upload `files` of directory `source` as artefact `name`, the manifest last; False when
    the tier is read-only or the store failed."""
    for file in files:
        if not remote.push_object(f"{name}/{file}", Path(source) / _plain(file)):
            return False
    manifest = {"files": list(files), "created": time.time(), "host": socket.gethostname()}
    with tempfile.TemporaryDirectory(prefix="vllm-aot-manifest-") as tmp:
        path = Path(tmp) / MANIFEST
        path.write_text(json.dumps(manifest))
        return remote.push_object(f"{name}/{MANIFEST}", path)


def fetch_tree(
    remote: RemoteTier,
    name: str,
    target: Path,
    accept: Callable[[Path], bool] = lambda directory: True,
) -> bool:
    """Install artefact `name` at directory `target` (replaced), verified and whole; False, with
    one warning when the store has something unusable, when it cannot."""
    if not has_tree(remote, name):
        return False
    try:
        with staged_dir(target) as staging:
            if remote.fetch_object(f"{name}/{MANIFEST}", staging / MANIFEST) is None:
                raise UnusableArtefact("its manifest is missing, unsigned or corrupt")
            files = _manifest_files(json.loads((staging / MANIFEST).read_text()))
            (staging / MANIFEST).unlink()
            for file in files:
                if remote.fetch_object(f"{name}/{file}", staging / file) is None:
                    raise UnusableArtefact(f"{file} is missing, unsigned or corrupt")
            if not accept(staging):
                raise UnusableArtefact("its contents are not what this installation expects")
    except Exception as exc:  # a remote failure is a miss: the caller builds instead
        logger.warning(
            "vllm-aot cache: %s in %s is unusable (%s); ignoring it", name, remote.url, exc
        )
        return False
    return True


def _plain(file: str) -> str:
    if not _PLAIN_NAME.fullmatch(file) or file in (".", ".."):
        raise UnusableArtefact(f"{file!r} is not a plain file name")
    return file


def _manifest_files(manifest: object) -> list[str]:
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or not files:
        raise UnusableArtefact("its manifest lists no files")
    return [_plain(file) for file in files]
