"""What a writer of the remote store without the signing key can put there: a signature that is
not ASCII, JSON nested too deep to parse, a size no deadline can hold, a meta or record too large
to read. Each is that object's miss with one warning naming it; the start goes on and compiles
what it refused (docs/faults.md)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TINY_CACHE_CONFIG, tiny_arch
from tests.test_cache_trust import KEY, NAMES, fill, make_cache, shared_entries, uploaded, warnings
from vllm_aot.cache.keys import arch_digest
from vllm_aot.cache.remote_tier import MAX_JSON_BYTES
from vllm_aot.cache.trust import Trust

pytestmark = pytest.mark.unit

NESTED = "[" * 1100 + "]" * 1100  # RecursionError in json.loads


def _non_ascii_signature(meta: dict) -> str:
    return json.dumps({**meta, "signature": "hmac-sha256:" + "é" * 64})


def _nested(meta: dict) -> str:
    return NESTED


def _huge_size(meta: dict) -> str:
    return json.dumps({**meta, "bytes": 10**400})


def _too_large(meta: dict) -> str:
    return json.dumps({**meta, "padding": "x" * MAX_JSON_BYTES})


def _forgeries(*forges) -> list:
    """(signing key, forgery) pairs: without a key a signature is not read, so it forges nothing."""
    return [
        pytest.param(key, forge, id=f"{'signed' if key else 'unsigned'}-{forge.__name__[1:]}")
        for key in (None, KEY)
        for forge in forges
        if key or forge is not _non_ascii_signature
    ]


@pytest.mark.parametrize(
    ("key", "forge"), _forgeries(_non_ascii_signature, _nested, _huge_size, _too_large)
)
def test_a_forged_meta_is_a_miss_with_one_warning(tmp_path, caplog, key, forge):
    url = uploaded(tmp_path, signing_key=key)
    victim = shared_entries(tmp_path / "shared")[0]
    meta = json.loads((victim / "meta.json").read_text())
    (victim / "meta.json").write_text(forge(meta))
    caplog.clear()
    fresh = make_cache(tmp_path / "fresh", remote_url=url, signing_key=key)
    outcome = fill(fresh, tmp_path / "log")
    assert len(outcome.names("compiled")) == 1
    assert sorted(outcome.names("remote") + outcome.names("compiled")) == NAMES
    refused = [w for w in warnings(caplog) if "refusing" in w]
    assert len(refused) == 1 and victim.name in refused[0]


@pytest.mark.parametrize(("key", "forge"), _forgeries(_non_ascii_signature, _nested, _too_large))
def test_a_forged_registry_record_is_skipped_with_one_warning(tmp_path, caplog, key, forge):
    url = uploaded(tmp_path, signing_key=key)
    arch = arch_digest(tiny_arch())
    record = next((tmp_path / "shared" / "registry" / arch).glob("*.json"))
    (record.parent / "forged.json").write_text(forge(json.loads(record.read_text())))
    caplog.clear()
    cache = make_cache(tmp_path / "cache", remote_url=url, signing_key=key)
    assert [e.location for e in cache.registry.entries(arch)] == [url]
    said = [w for w in warnings(caplog) if "forged.json" in w]
    assert len(said) == 1, warnings(caplog)


@pytest.mark.parametrize(
    "signature", ["hmac-sha256:" + "é" * 64, "\udcff", "", "hmac-sha256:" + "0" * 64]
)
def test_any_signature_string_is_refused_not_raised(signature):
    trust = Trust(KEY)
    signed = trust.sign("registry/x.json", {"a": 1})
    assert trust.refusal("registry/x.json", signed) is None
    assert "signature" in trust.refusal("registry/x.json", {**signed, "signature": signature})


def test_a_good_start_reads_every_entry_from_the_store(tmp_path):
    # The caps leave real metas and records alone.
    url = uploaded(tmp_path, signing_key=KEY)
    fresh = make_cache(tmp_path / "fresh", remote_url=url, signing_key=KEY)
    outcome = fresh.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=None)
    assert sorted(outcome.names("remote")) == NAMES
