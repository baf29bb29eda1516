"""Remote stores of the compile cache: a shared directory or S3, behind one object interface.

A store holds objects by name (`entries/<key>/program.pt2`, `entries/<key>/meta.json`,
`registry/<arch>/<config>.json`) and only copies them: what is believed of an object, and what a
failing store costs, is `remote_tier.RemoteTier`'s business. Selected by URL: `file:///shared/dir`
(or a plain path) for an NFS-style directory, `s3://bucket/prefix` for S3 (boto3;
`AWS_ENDPOINT_URL` for S3-compatible servers; connections and reads time out after `timeout` s).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from vllm_aot.files import staged_path


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

    def __init__(self, bucket: str, prefix: str = "", *, timeout: float = 30.0) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"
        # Bounded: a dead or silent endpoint costs seconds, not botocore's 60 s x 5 attempts.
        config = Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"max_attempts": 2, "mode": "standard"},
        )
        self._client = boto3.client("s3", config=config)

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


def open_store(url: str, *, timeout: float = 30.0) -> RemoteStore:
    """The store a URL names; ValueError for an URL of no supported kind."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"remote cache URL {url!r} names no bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, timeout=timeout)
    if parsed.scheme in ("file", ""):
        return DirectoryStore(parsed.path if parsed.scheme else url)
    raise ValueError(f"remote cache URL {url!r}: supported schemes are file:// and s3://")


def entry_object(key: str, file: str) -> str:
    """A compile cache entry's object name: `entries/<key>/program.pt2` or `.../meta.json`."""
    return f"entries/{key}/{file}"
