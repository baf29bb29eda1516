"""The compile cache against a remote store it cannot trust or reach: signatures, read-only mode,
names that are not digests, a store that is down, slow or corrupted, malformed registry records,
and a failed upload while compiling. Each fault is a miss with a warning, never a stopped start
and never a strange program loaded. Programs come from the fake compiler (tests/cache_worker)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.cache_worker import fake_compile
from tests.helpers import TINY_CACHE_CONFIG, tiny_arch
from tests.test_cache import s3_server  # noqa: F401 (the moto fixture)
from vllm_aot.cache.admin import cleanup, sync
from vllm_aot.cache.keys import arch_digest
from vllm_aot.cache.local import LocalCache, file_sha256
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.cache.registry import CompiledConfiguration, select_configuration
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import all_program_keys

pytestmark = pytest.mark.unit

NAMES = sorted(k.name for k in all_program_keys(TINY_CACHE_CONFIG))
KEY = b"deployment-secret-0123456789abcdef"


class MemoryStore:
    """A remote store in a dict: every call (counted in `num_calls`) sleeps `delay` s, and the
    calls named in `failing` raise as a broken network would."""

    def __init__(self, delay: float = 0.0, failing: tuple[str, ...] = ()) -> None:
        self.url, self.objects, self.delay, self.failing = "memory://test", {}, delay, failing
        self.num_calls = 0

    def _call(self, what: str) -> None:
        self.num_calls += 1
        time.sleep(self.delay)
        if what in self.failing:
            raise ConnectionResetError(f"{what}: connection reset by the test")

    def get(self, name: str, dest: Path) -> bool:
        self._call("get")
        if name not in self.objects:
            return False
        Path(dest).write_bytes(self.objects[name])
        return True

    def put(self, name: str, source: Path) -> None:
        self._call("put")
        self.objects[name] = Path(source).read_bytes()

    def list(self, prefix: str) -> list[str]:
        self._call("list")
        return sorted(name for name in self.objects if name.startswith(prefix))


def make_cache(root: Path, store=None, **settings) -> ProgramCache:
    return ProgramCache(CacheSettings(root=root, **settings), store=store)


def fill(cache: ProgramCache, log: Path, compile_fn=None):
    return cache.ensure(
        tiny_arch(), TINY_CACHE_CONFIG, compile_fn=compile_fn or fake_compile(log, 0)
    )


def warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("vllm_aot.cache") and r.levelno >= logging.WARNING
    ]


def shared_entries(shared: Path) -> list[Path]:
    return sorted(p for p in (shared / "entries").iterdir() if p.is_dir())


def uploaded(tmp_path: Path, **settings) -> str:
    """A shared directory filled by a builder that uploads (with `settings`); its URL."""
    url = f"file://{tmp_path / 'shared'}"
    builder = make_cache(tmp_path / "builder", remote_url=url, upload=True, **settings)
    fill(builder, tmp_path / "builder.log")
    return url


def test_signed_entries_are_fetched_and_a_forged_one_is_refused(tmp_path, caplog):
    url = uploaded(tmp_path, signing_key=KEY)
    fresh = make_cache(tmp_path / "fresh", remote_url=url, signing_key=KEY)
    assert fresh.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=None).names("remote") == NAMES
    # Someone who can write the store, but has no key, replaces a program and fixes its meta.
    victim = shared_entries(tmp_path / "shared")[0]
    forged = b"\x7fELF a stranger's code"
    (victim / "program.pt2").write_bytes(forged)
    meta = json.loads((victim / "meta.json").read_text())
    meta.update(sha256=file_sha256(victim / "program.pt2"), bytes=len(forged))
    (victim / "meta.json").write_text(json.dumps(meta))
    # ...and files a copy of another signed entry under a second key.
    moved = shared_entries(tmp_path / "shared")[1]
    for name in ("program.pt2", "meta.json"):
        shutil.copyfile(shared_entries(tmp_path / "shared")[2] / name, moved / name)
    caplog.clear()
    third = make_cache(tmp_path / "third", remote_url=url, signing_key=KEY)
    outcome = fill(third, tmp_path / "third.log")
    compiled = {
        path.parent.name
        for pk, path in outcome.paths.items()
        if pk.name in outcome.names("compiled")
    }
    assert compiled == {victim.name, moved.name}
    assert len(outcome.names("remote")) == len(NAMES) - 2
    refused = warnings(caplog)
    assert len(refused) == 2 and all("refusing" in w for w in refused)
    assert any(victim.name in w and "signature" in w for w in refused)
    assert all(forged not in path.read_bytes() for path in outcome.paths.values())


@pytest.mark.parametrize("builder_key", [None, b"another-deployment-key-0123456789"])
def test_unsigned_or_wrongly_signed_objects_are_refused(tmp_path, caplog, builder_key):
    url = uploaded(tmp_path, signing_key=builder_key)
    reader = make_cache(tmp_path / "reader", remote_url=url, signing_key=KEY)
    assert reader.registry.entries(arch_digest(tiny_arch())) == []  # the record is refused too
    outcome = fill(reader, tmp_path / "reader.log")
    assert sorted(outcome.names("compiled")) == NAMES and outcome.names("remote") == []
    refused = [w for w in warnings(caplog) if "refusing" in w]
    assert len(refused) == len(NAMES) + 1  # each entry and the registry record, once


def test_without_a_key_the_store_is_trusted_as_is_and_the_log_says_so_once(tmp_path, caplog):
    url = uploaded(tmp_path)
    fresh = make_cache(tmp_path / "fresh", remote_url=url)
    fresh.registry.entries(arch_digest(tiny_arch()))
    assert sorted(fill(fresh, tmp_path / "fresh.log").names("remote")) == NAMES
    said = warnings(caplog)
    assert len(said) == 1 and "trusted as-is" in said[0] and "SIGNING_KEY" in said[0]


def test_a_read_only_store_is_never_written(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    monkeypatch.setenv("VLLM_AOT_REMOTE_CACHE", f"file://{shared}")
    monkeypatch.setenv("VLLM_AOT_CACHE_READ_ONLY", "1")
    with pytest.raises(ValueError, match="read-only"):
        CacheSettings.from_env(upload=True)
    cache = ProgramCache(CacheSettings.from_env(root=tmp_path / "cache"))
    assert sorted(fill(cache, tmp_path / "log").names("compiled")) == NAMES
    with pytest.raises(ValueError, match="read-only"):
        sync(cache, push=True, pull=False)
    assert cache.remote.push_entry(cache.local.entry_keys()[0], cache.local) is False
    assert not shared.exists()


def test_names_that_are_not_digests_never_become_paths(tmp_path, caplog):
    store = MemoryStore()
    builder = make_cache(tmp_path / "builder", store, upload=True)
    fill(builder, tmp_path / "builder.log")
    good = next(n for n in store.objects if n.endswith("/meta.json") and n.startswith("entries/"))
    for bad in ("entries/../meta.json", "entries/../../escape/meta.json"):
        store.objects[bad] = store.objects[good]
        store.objects[bad.replace("meta.json", "program.pt2")] = b"x"
    record = next(n for n in store.objects if n.startswith("registry/"))
    evil = {**json.loads(store.objects[record]), "arch_digest": "../../escape"}
    store.objects["registry/0123456789abcdef/evil.json"] = json.dumps(evil).encode()
    fresh = make_cache(tmp_path / "fresh", store)
    assert sync(fresh, push=False, pull=True) == (0, len(NAMES))
    assert not (tmp_path / "escape").exists() and len(fresh.registry.local_entries()) == 1
    said = warnings(caplog)
    assert sum("not a cache key" in w for w in said) == 2
    assert any("evil.json" in w and "not a hex digest" in w for w in said)
    with pytest.raises(ValueError, match="not a cache key"):
        fresh.local.entry_dir("../escape")


def test_a_store_that_is_down_is_a_miss_with_one_warning(tmp_path, monkeypatch, caplog):
    pytest.importorskip("boto3")
    from vllm_aot.processes import free_port

    for name, value in (
        ("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}"),  # nothing listens there
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(name, value)
    settings = {"remote_url": "s3://compiled/team", "remote_timeout": 2.0}
    cold = make_cache(tmp_path / "cache", upload=True, **settings)
    assert sorted(fill(cold, tmp_path / "log").names("compiled")) == NAMES
    assert len(warnings(caplog)) == 1 and "not asking it again" in warnings(caplog)[0]
    caplog.clear()
    warm = make_cache(tmp_path / "cache", **settings)  # serve's selection, then its start
    assert len(warm.registry.entries(arch_digest(tiny_arch()))) == 1
    assert warm.missing(tiny_arch(), TINY_CACHE_CONFIG) == []
    assert sorted(fill(warm, tmp_path / "log").names("local")) == NAMES
    assert len(warnings(caplog)) == 1


def test_a_slow_store_costs_one_deadline_not_one_per_program(tmp_path, caplog):
    store = MemoryStore(delay=60.0)  # never answers within the deadline
    cache = make_cache(tmp_path / "cache", store, remote_timeout=0.5)
    assert sorted(fill(cache, tmp_path / "log").names("compiled")) == NAMES
    assert store.num_calls == 1  # the first call's deadline; none asked after it
    assert len(warnings(caplog)) == 1 and "no answer within" in warnings(caplog)[0]


def test_corrupted_bytes_or_meta_are_refused_naming_the_entry(tmp_path, caplog):
    url = uploaded(tmp_path)
    entries = shared_entries(tmp_path / "shared")
    program = entries[0] / "program.pt2"
    program.write_bytes(b"garbage" + program.read_bytes()[7:])  # bytes flipped in transit
    (entries[1] / "meta.json").write_text("{not json")
    (entries[2] / "meta.json").write_text("[1, 2]")
    (entries[3] / "meta.json").write_text(json.dumps({"key": entries[3].name}))  # no digest
    caplog.clear()
    outcome = fill(make_cache(tmp_path / "fresh", remote_url=url), tmp_path / "fresh.log")
    assert len(outcome.names("compiled")) == 4 and len(outcome.names("remote")) == len(NAMES) - 4
    refused = [w for w in warnings(caplog) if "refusing" in w]
    assert len(refused) == 4 and all(any(e.name in w for w in refused) for e in entries[:4])
    assert "corrupted" in next(w for w in refused if entries[0].name in w)


def test_malformed_registry_records_are_skipped_with_a_warning(tmp_path, caplog):
    url = uploaded(tmp_path)
    arch = arch_digest(tiny_arch())
    cache = make_cache(tmp_path / "cache", remote_url=url)
    batch_of_4 = {**TINY_CACHE_CONFIG.to_dict(), "max_num_seqs": 4, "decode_batch_buckets": (4,)}
    good = CompiledConfiguration.build(tiny_arch(), RuntimeConfig(**batch_of_4), {})
    cache.registry.record(good)
    local_dir = tmp_path / "cache" / "registry" / arch
    (local_dir / "truncated.json").write_text('{"arch_digest": "')
    broken = {k: v for k, v in good.to_json().items() if k != "runtime"}
    (local_dir / "no-runtime.json").write_text(json.dumps(broken))
    remote_dir = tmp_path / "shared" / "registry" / arch
    bad_shapes = {**good.to_json(), "runtime": {**good.runtime, "max_model_len": 100}}
    (remote_dir / "bad-shapes.json").write_text(json.dumps(bad_shapes))
    entries = cache.registry.entries(arch)
    assert len(entries) == 2  # the local record and the builder's remote one
    best, _ = select_configuration(entries, {}, num_cores=1)
    assert best is not None
    said = warnings(caplog)
    for name in ("truncated.json", "no-runtime.json", "bad-shapes.json"):
        assert sum(name in w for w in said) == 1
    removed = cleanup(cache, dry_run=False)
    assert sum("malformed registry record" in what for what in removed) == 2
    assert cache.registry.malformed_local() == []


def threaded(compile_fn):
    """Call `compile_fn` the way runtime.compiler's workers do: callbacks run on a reader thread,
    and an exception there ends that thread only."""

    def run(jobs, on_done) -> None:
        reader = threading.Thread(target=compile_fn, args=(jobs, on_done))
        reader.start()
        reader.join()

    return run


def test_an_upload_error_while_compiling_is_a_warning_and_start_up_finishes(tmp_path, caplog):
    store = MemoryStore(failing=("put",))
    cache = make_cache(tmp_path / "cache", store, upload=True)
    outcome = fill(cache, tmp_path / "log", threaded(fake_compile(tmp_path / "log", 0)))
    assert sorted(outcome.names("compiled")) == NAMES  # every program, in the local cache
    assert len(cache.local.entry_keys()) == len(NAMES)
    said = warnings(caplog)
    assert len(said) == 1 and "ConnectionResetError" in said[0]


def test_a_compile_that_never_reports_a_program_fails_naming_it(tmp_path):
    def forgetful(jobs, on_done) -> None:
        for key, path in jobs[1:]:
            path.write_bytes(b"built")
            on_done(key, 0.0)

    cache = make_cache(tmp_path / "cache")
    with pytest.raises(RuntimeError, match="without committing"):
        fill(cache, tmp_path / "log", forgetful)
    assert len(cache.local.failures()) == 1
    again = fill(cache, tmp_path / "log")
    assert len(again.names("compiled")) == 1 and len(again.names("local")) == len(NAMES) - 1


def test_staging_directories_are_unique_and_private(tmp_path):
    local = LocalCache(tmp_path)
    key = "0" * 32
    first, second = local.staging_dir(key), local.staging_dir(key)
    assert first != second and first.is_dir() and second.is_dir()
