"""What the compile cache believes of a remote store: signatures and names.

A remote entry is a shared library that start-up loads, so whoever can write the store can run
code in every process that fetches from it. With a signing key (HMAC-SHA256, a secret the
deployment holds: `VLLM_AOT_CACHE_SIGNING_KEY` or `VLLM_AOT_CACHE_SIGNING_KEY_FILE`), every object
an uploader writes carries a signature over its object name and its meta (which holds the payload's
sha256 and size), and a reader refuses any object whose signature is missing or wrong before a
byte of it is committed locally or loaded. The name binds the signature to one cache key: a signed
entry copied under another key is refused too. Without a key, remote objects are trusted as-is.

Names read from a store (cache keys, architecture digests) become local paths, so they are
accepted only as lowercase hex digests of the expected length (`is_hex_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIGNATURE_FIELD = "signature"
_SCHEME = "hmac-sha256:"
MIN_KEY_BYTES = 16
_HEX = frozenset("0123456789abcdef")


def is_hex_digest(name: object, length: int) -> bool:
    """Whether `name` is `length` lowercase hex digits (a cache key or digest, never a path)."""
    return isinstance(name, str) and len(name) == length and set(name) <= _HEX


def signing_key(value: str | None, key_file: str | None) -> bytes | None:
    """The HMAC key from its value or the file holding it (trailing whitespace stripped); None
    when neither is given. ValueError when both are, or the key is under MIN_KEY_BYTES."""
    if value and key_file:
        raise ValueError(
            "both VLLM_AOT_CACHE_SIGNING_KEY and VLLM_AOT_CACHE_SIGNING_KEY_FILE are set; give one"
        )
    if key_file:
        key = Path(key_file).expanduser().read_bytes().rstrip()
    elif value:
        key = value.encode()
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the compile cache's signing key has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return key


@dataclass(frozen=True)
class Trust:
    """Signs what this process uploads and checks what it fetches (see the module docstring)."""

    key: bytes | None = field(default=None, repr=False)  # None: remote objects trusted as-is

    @property
    def is_signing(self) -> bool:
        return self.key is not None

    def sign(self, name: str, meta: dict[str, Any]) -> dict[str, Any]:
        """`meta` with the signature for object `name` (unchanged without a key)."""
        unsigned = {k: v for k, v in meta.items() if k != SIGNATURE_FIELD}
        if self.key is None:
            return unsigned
        return {**unsigned, SIGNATURE_FIELD: self._mac(name, unsigned)}

    def refusal(self, name: str, meta: dict[str, Any]) -> str | None:
        """Why `meta`, read as object `name`'s, is not to be believed; None when it is (always
        None without a key)."""
        if self.key is None:
            return None
        signature = meta.get(SIGNATURE_FIELD)
        if not isinstance(signature, str):
            return "it is not signed and a signing key is configured"
        if not signature.isascii():
            return "its signature is not ASCII"
        unsigned = {k: v for k, v in meta.items() if k != SIGNATURE_FIELD}
        try:
            expected = self._mac(name, unsigned)
        except (RecursionError, TypeError, ValueError) as exc:  # what json.dumps refuses
            return f"it cannot be checked ({type(exc).__name__})"
        if not hmac.compare_digest(signature.encode("ascii"), expected.encode("ascii")):
            return "its signature does not match this deployment's signing key"
        return None

    def _mac(self, name: str, unsigned: dict[str, Any]) -> str:
        assert self.key is not None
        blob = json.dumps({"object": name, "meta": unsigned}, sort_keys=True, separators=(",", ":"))
        return _SCHEME + hmac.new(self.key, blob.encode(), hashlib.sha256).hexdigest()
