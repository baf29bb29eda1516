"""Remote tiers of the compile cache: a shared directory or S3, behind one object interface.

A store holds objects by name (`entries/<key>/program.pt2`, `entries/<key>/meta.json`,
`registry/<arch>/<config>.json`). An entry's meta is written after its program, so a reader that
finds the meta finds the whole entry; a fetched program is verified against the meta's digest
before it enters the local cache. Selected by URL: `file:///shared/dir` (or a plain path) for an
NFS-style directory, `s3://bucket/prefix` for S3 (boto3; `AWS_ENDPOINT_URL` for S3-compatible
servers).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from vllm_aot.cache.local import META_FILE, PROGRAM_FILE, LocalCache, file_sha256
from vllm_aot.files import staged_path

logger = logging.getLogger(__name__)


class RemoteStore(Protocol):
    url: str

    def get(self, name: str, dest: Path) -> bool:
        """Copy object `name` to `dest` (whole or not at all); False when it does not exist."""
        ...

    def put(self, name: str, source: Path) -> None:
        """Store `source` as `name`; readers see the old object or the new one, never half."""
        ...

    def list(self, prefix: str) -> list[str]:
        """Names of the objects under `prefix`."""
        ...


class DirectoryStore:
    """A directory shared between machines (NFS and the like); writes are staged and renamed."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def get(self, name: str, dest: Path) -> bool:
        source = self.root / name
        if not source.is_file():
            return False
        with staged_path(dest) as staging:
            shutil.copyfile(source, staging)
        return True

    def put(self, name: str, source: Path) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with staged_path(target) as staging:
            shutil.copyfile(source, staging)

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )


class S3Store:
    """An S3 bucket (or S3-compatible server: set AWS_ENDPOINT_URL) under a key prefix."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        import boto3

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"
        self._client = boto3.client("s3")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def get(self, name: str, dest: Path) -> bool:
        from botocore.exceptions import ClientError

        try:
            with staged_path(dest) as staging:
                self._client.download_file(self.bucket, self._key(name), str(staging))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return False
            raise
        return True

    def put(self, name: str, source: Path) -> None:
        self._client.upload_file(str(source), self.bucket, self._key(name))

    def list(self, prefix: str) -> list[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        )
        cut = len(self._key(""))
        return sorted(obj["Key"][cut:] for page in pages for obj in page.get("Contents", []))


def open_store(url: str) -> RemoteStore:
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"remote cache URL {url!r} names no bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path)
    if parsed.scheme in ("file", ""):
        return DirectoryStore(parsed.path if parsed.scheme else url)
    raise ValueError(f"remote cache URL {url!r}: supported schemes are file:// and s3://")


def _entry_object(key: str, file: str) -> str:
    return f"entries/{key}/{file}"


def fetch_entry(store: RemoteStore, key: str, local: LocalCache) -> Path | None:
    """Copy entry `key` from `store` into `local` (verified); its program file, or None."""
    staging = local.staging_dir(key)
    try:
        if not store.get(_entry_object(key, META_FILE), staging / "remote-meta.json"):
            return None
        meta = json.loads((staging / "remote-meta.json").read_text())
        (staging / "remote-meta.json").unlink()
        program = staging / PROGRAM_FILE
        if not store.get(_entry_object(key, PROGRAM_FILE), program):
            return None
        if file_sha256(program) != meta.get("sha256"):
            logger.warning("vllm-aot cache: %s in %s is corrupted; ignoring it", key, store.url)
            return None
        kept = {k: v for k, v in meta.items() if k in ("name", "compile_seconds", "fingerprint")}
        path = local.commit(key, staging, {**kept, "fetched_from": store.url})
        staging = None
        return path
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def push_entry(store: RemoteStore, key: str, local: LocalCache) -> None:
    """Upload local entry `key` (program first, meta last: the meta marks it complete)."""
    entry = local.entry_dir(key)
    store.put(_entry_object(key, PROGRAM_FILE), entry / PROGRAM_FILE)
    store.put(_entry_object(key, META_FILE), entry / META_FILE)


def remote_keys(store: RemoteStore) -> set[str]:
    """Keys of the complete entries in `store`."""
    return {name.split("/")[1] for name in store.list("entries/") if name.endswith(f"/{META_FILE}")}


def put_json(store: RemoteStore, name: str, payload: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "object.json"
        path.write_text(json.dumps(payload, indent=2, sort_keys=True))
        store.put(name, path)


def get_json(store: RemoteStore, name: str) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "object.json"
        return json.loads(path.read_text()) if store.get(name, path) else None
