"""The remote store as the compile cache uses it: verified, optionally read-only, never fatal.

Protocol: every method answers a miss (None, False, nothing) instead of raising.
- A store that fails (unreachable, refusing, erroring mid-copy) or is slower than its deadline
  is logged once, with the reason, and not asked again by this tier (`failure` says why): start-up
  goes on from the local cache or compiles, and never waits on a dead store once per program.
  Deadlines: `timeout` s for a listing or a meta, plus one second per MB for a payload.
- An object that fails verification is refused with one warning naming it, and the store stays in
  use for the others: a meta or record over `MAX_JSON_BYTES` or that is not a JSON object (nested
  too deep included), a meta without the payload's sha256 and a size up to `MAX_PAYLOAD_BYTES`, a
  missing or wrong signature when a signing key is set (`Trust`), a payload whose size or sha256
  differs from its meta, a cache key that is not a hex digest. Any other error reading, parsing
  or checking one object is that object's refusal too: nothing a writer of the store puts there
  stops a start.
- Without a signing key, the first object read logs, once, that the store is trusted as-is.

An object travels with a meta object (`<name>.meta.json` unless named otherwise; a compile cache
entry's is `entries/<key>/meta.json`): the payload's sha256 and bytes plus what the uploader adds,
signed with the object's name. Uploads put the payload first and the meta last, so a reader that
finds the meta finds the whole object. A read-only tier never writes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from vllm_aot.cache.keys import KEY_LENGTH
from vllm_aot.cache.local import META_FILE, PROGRAM_FILE, LocalCache, file_sha256
from vllm_aot.cache.remote import RemoteStore, entry_object
from vllm_aot.cache.trust import Trust, is_hex_digest
from vllm_aot.files import sync_directory

logger = logging.getLogger(__name__)

META_SUFFIX = ".meta.json"
# A meta or registry record is a few hundred bytes; a larger one is refused before it is parsed.
MAX_JSON_BYTES = 1 << 20
# The largest payload a meta may name (1 PiB): its deadline stays a number a thread can wait for.
MAX_PAYLOAD_BYTES = 1 << 50
# A payload's deadline grows by one second per this many bytes (a slow but moving link is fine).
_SLOWEST_BYTES_PER_SECOND = 1_000_000
# Meta fields a fetched entry keeps in the local cache (the rest is recomputed on commit).
_KEPT_ENTRY_FIELDS = ("name", "compile_seconds", "fingerprint")


class _Miss(Exception):
    """The object is absent, refused, or the store failed (already logged)."""


class RemoteTier:
    def __init__(
        self,
        store: RemoteStore,
        *,
        trust: Trust | None = None,  # None: no signing key, objects trusted as-is
        read_only: bool = False,
        timeout: float = 30.0,
    ) -> None:
        self.store = store
        self.trust = trust or Trust()
        self.read_only = read_only
        self.timeout = timeout
        self.failure: str | None = None  # why the store is no longer asked (its first failure)
        self._has_warned_unsigned = False

    @property
    def url(self) -> str:
        return self.store.url

    # -- objects (any payload: compiled programs, kernel libraries, prepared models) -----------

    def fetch_object(
        self,
        name: str,
        dest: Path,
        *,
        meta_name: str | None = None,
        expect: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Copy object `name` to `dest` (whole, renamed into place) once it is verified; its meta,
        or None when absent, refused or the store failed. `expect`: fields its meta must hold."""
        dest = Path(dest)
        if self.failure is not None:
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            dir=dest.parent, prefix=".fetch-", ignore_cleanup_errors=True
        ) as tmp:
            payload = Path(tmp) / "payload"
            try:
                meta = self._verified_copy(name, meta_name or name + META_SUFFIX, payload, expect)
            except _Miss:
                return None
            except Exception as exc:  # whatever the store's bytes provoke is that object's miss
                self._warn_refused(name, f"it cannot be checked ({type(exc).__name__}: {exc})")
                return None
            os.replace(payload, dest)
        sync_directory(dest.parent)
        return meta

    def push_object(
        self,
        name: str,
        source: Path,
        meta: dict[str, Any] | None = None,
        *,
        meta_name: str | None = None,
    ) -> bool:
        """Upload `source` as `name`, then its signed meta (`meta` plus sha256 and bytes); False
        when read-only or the store failed."""
        if self.read_only:
            return False
        size = Path(source).stat().st_size
        meta = {**(meta or {}), "sha256": file_sha256(Path(source)), "bytes": size}
        deadline = self.timeout + size / _SLOWEST_BYTES_PER_SECOND
        try:
            self._call(f"uploading {name}", self.store.put, name, Path(source), seconds=deadline)
            self._put_json(meta_name or name + META_SUFFIX, self.trust.sign(name, meta))
        except _Miss:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """Names under `prefix`; empty when the store failed."""
        try:
            return self._call(f"listing {prefix}", self.store.list, prefix)
        except _Miss:
            return []

    # -- compile cache entries -----------------------------------------------------------------

    def fetch_entry(self, key: str, local: LocalCache) -> Path | None:
        """Entry `key` into `local`, verified before it is committed; its program file, or None."""
        if not is_hex_digest(key, KEY_LENGTH):
            self._warn_refused(entry_object(key, META_FILE), "the name is not a cache key")
            return None
        if self.failure is not None:
            return None
        staging = local.staging_dir(key)
        try:
            meta = self.fetch_object(
                entry_object(key, PROGRAM_FILE),
                staging / PROGRAM_FILE,
                meta_name=entry_object(key, META_FILE),
                expect={"key": key},
            )
            if meta is None:
                return None
            kept = {k: v for k, v in meta.items() if k in _KEPT_ENTRY_FIELDS}
            path = local.commit(key, staging, {**kept, "fetched_from": self.url})
            staging = None
            return path
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def push_entry(self, key: str, local: LocalCache) -> bool:
        """Upload local entry `key` (verified first); False when read-only, absent or failed."""
        program, meta = local.lookup(key), local.read_meta(key)
        if program is None or meta is None:
            return False
        name = entry_object(key, PROGRAM_FILE)
        return self.push_object(name, program, meta, meta_name=entry_object(key, META_FILE))

    def entry_keys(self) -> set[str]:
        """Keys of the complete entries in the store; names that are not keys are skipped."""
        keys = set()
        for name in self.list("entries/"):
            if not name.endswith(f"/{META_FILE}"):
                continue
            parts = name.split("/")
            if len(parts) == 3 and is_hex_digest(parts[1], KEY_LENGTH):
                keys.add(parts[1])
            else:
                self._warn_refused(name, "the name is not a cache key")
        return keys

    # -- JSON records (the registry) -----------------------------------------------------------

    def records(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        """(name, payload) of each JSON object under `prefix` whose signature holds."""
        found = []
        for name in self.list(prefix):
            if not name.endswith(".json"):
                continue
            try:
                payload = self._read_json(name)
                if refusal := self.trust.refusal(name, payload):
                    self._refuse(name, refusal)
            except _Miss:
                if self.failure is not None:
                    break
                continue
            except Exception as exc:  # whatever the store's bytes provoke is that record's miss
                self._warn_refused(name, f"it cannot be checked ({type(exc).__name__}: {exc})")
                continue
            found.append((name, payload))
        return found

    def put_record(self, name: str, payload: dict[str, Any]) -> bool:
        """Store a JSON record, signed; False when read-only or the store failed."""
        if self.read_only:
            return False
        try:
            self._put_json(name, self.trust.sign(name, payload))
        except _Miss:
            return False
        return True

    # -- the checks ----------------------------------------------------------------------------

    def _verified_copy(
        self, name: str, meta_name: str, dest: Path, expect: dict[str, Any] | None
    ) -> dict[str, Any]:
        meta = self._read_json(meta_name)
        sha256, size = meta.get("sha256"), meta.get("bytes")
        if not is_hex_digest(sha256, 64) or not isinstance(size, int) or size < 0:
            self._refuse(meta_name, "its meta lacks the payload's sha256 and bytes")
        if size > MAX_PAYLOAD_BYTES:
            self._refuse(meta_name, f"its meta names more than {MAX_PAYLOAD_BYTES} bytes")
        if refusal := self.trust.refusal(name, meta):
            self._refuse(name, refusal)
        if wrong := {k: meta.get(k) for k, v in (expect or {}).items() if meta.get(k) != v}:
            self._refuse(name, f"its meta says {wrong}, expected {expect}")
        deadline = self.timeout + size / _SLOWEST_BYTES_PER_SECOND
        if not self._call(f"fetching {name}", self.store.get, name, dest, seconds=deadline):
            raise _Miss
        actual_size, actual = dest.stat().st_size, file_sha256(dest)
        if (actual_size, actual) != (size, sha256):
            self._refuse(
                name,
                f"corrupted: its {actual_size} bytes (sha256 {actual[:12]}...) are not the "
                f"{size} bytes (sha256 {sha256[:12]}...) its meta names",
            )
        return meta

    def _read_json(self, name: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="vllm-aot-remote-") as tmp:
            path = Path(tmp) / "object.json"
            if not self._call(f"reading {name}", self.store.get, name, path):
                raise _Miss
            if (size := path.stat().st_size) > MAX_JSON_BYTES:
                self._refuse(name, f"it has {size} bytes, over {MAX_JSON_BYTES} for a JSON object")
            try:
                payload = json.loads(path.read_bytes())
            except ValueError as exc:
                self._refuse(name, f"it is not JSON ({exc})")
            except RecursionError:
                self._refuse(name, "it is JSON nested too deep to read")
        if not isinstance(payload, dict):
            self._refuse(name, "it is not a JSON object")
        self._warn_unsigned_once()
        return payload

    def _put_json(self, name: str, payload: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="vllm-aot-remote-") as tmp:
            path = Path(tmp) / "object.json"
            path.write_text(json.dumps(payload, indent=2, sort_keys=True))
            self._call(f"uploading {name}", self.store.put, name, path)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, seconds: float = 0.0) -> Any:
        """`fn(*args)` under a deadline (`seconds`, default `timeout`); a failure or a late answer
        marks the store failed (logged once) and raises _Miss, as does any call after that."""
        if self.failure is not None:
            raise _Miss
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn(*args)
            except Exception as exc:  # each store's client has its own errors: all are failures
                outcome["error"] = exc

        # A daemon thread: a call stuck in the network (or a hung mount) is abandoned, not waited.
        worker = threading.Thread(target=run, name="vllm-aot-remote-store", daemon=True)
        worker.start()
        worker.join(min(seconds or self.timeout, threading.TIMEOUT_MAX))
        if "value" in outcome:
            return outcome["value"]
        if "error" in outcome:
            error = outcome["error"]
            self.failure = f"{what}: {type(error).__name__}: {error}"
        else:
            self.failure = f"{what}: no answer within {seconds or self.timeout:.0f} s"
        logger.warning(
            "vllm-aot cache: remote store %s failed (%s); not asking it again in this process: "
            "programs come from the local cache or are compiled",
            self.url,
            self.failure,
        )
        raise _Miss

    def _refuse(self, name: str, why: str) -> NoReturn:
        self._warn_refused(name, why)
        raise _Miss

    def _warn_refused(self, name: str, why: str) -> None:
        logger.warning("vllm-aot cache: refusing %s from %s: %s", name, self.url, why)

    def _warn_unsigned_once(self) -> None:
        if self.trust.is_signing or self._has_warned_unsigned:
            return
        self._has_warned_unsigned = True
        logger.warning(
            "vllm-aot cache: no signing key is configured, so objects from %s are trusted as-is "
            "(whoever can write there can run code here); set VLLM_AOT_CACHE_SIGNING_KEY to sign "
            "uploads and refuse what is not signed",
            self.url,
        )
