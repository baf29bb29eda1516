"""A full disk, an interrupted upload, and `cache cleanup` racing a compiler: what the user sees,
that nothing half-written is ever loaded, and that one key never has two compilers
(docs/faults.md)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.cache_worker import fake_compile
from tests.helpers import TINY_CACHE_CONFIG, tiny_arch, wait_until
from vllm_aot.cache import local as local_module
from vllm_aot.cache.admin import cleanup
from vllm_aot.cache.local import CacheLockTimeout, LocalCache
from vllm_aot.cache.program_cache import CacheDiskFullError, CacheSettings, ProgramCache
from vllm_aot.cache.remote import DirectoryStore, entry_object
from vllm_aot.runtime.programs import all_program_keys

pytestmark = pytest.mark.unit

NAMES = sorted(k.name for k in all_program_keys(TINY_CACHE_CONFIG))


def _disk_fills_after(num_programs: int, log: Path, monkeypatch):
    """A compiler that commits `num_programs`, then finds the device full: its next write and
    every JSON record after it fail with ENOSPC."""
    real = fake_compile(log, 0.0)

    def compile_fn(jobs, on_done) -> None:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        real(jobs[:num_programs], on_done)
        monkeypatch.setattr(local_module, "write_json_atomic", full)
        full()

    return compile_fn


def test_a_full_disk_names_the_cache_and_leaves_only_whole_programs(tmp_path, monkeypatch):
    root, log = tmp_path / "cache", tmp_path / "compiled.log"
    cache = ProgramCache(CacheSettings(root=root))
    with pytest.raises(CacheDiskFullError, match=f"no space left .* {root}"):
        cache.ensure(
            tiny_arch(), TINY_CACHE_CONFIG, compile_fn=_disk_fills_after(2, log, monkeypatch)
        )
    monkeypatch.undo()  # space is freed
    assert len(cache.local.entry_keys()) == 2  # committed before the disk filled, and whole
    assert not list((root / "entries").glob(".staging-*"))  # nothing half-written left
    again = ProgramCache(CacheSettings(root=root, lock_timeout=0))
    outcome = again.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))
    assert len(outcome.names("local")) == 2  # no lock held, nothing rebuilt twice
    assert sorted(outcome.names("local") + outcome.names("compiled")) == NAMES


def test_an_upload_killed_between_program_and_meta_is_a_miss_not_a_load(tmp_path):
    root, store_dir, log = tmp_path / "a", tmp_path / "store", tmp_path / "compiled.log"
    builder = ProgramCache(CacheSettings(root=root, remote_url=f"file://{store_dir}", upload=True))
    builder.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))
    # What a kill -9 between the two writes of an upload leaves: the program, no meta.
    key = builder.local.entry_keys()[0]
    meta = next(
        p for p in store_dir.rglob("*") if p.is_file() and key in str(p) and "meta" in p.name
    )
    meta.unlink()
    assert (store_dir / entry_object(key, "program.pt2")).is_file()
    fresh = ProgramCache(CacheSettings(root=tmp_path / "b"), store=DirectoryStore(store_dir))
    outcome = fresh.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))
    assert len(outcome.names("compiled")) == 1  # the interrupted one is compiled here
    assert len(outcome.names("remote")) == len(NAMES) - 1
    recorded = json.loads((fresh.local.entries_dir / key / "meta.json").read_text())
    assert recorded["name"] in NAMES


def test_cleanup_never_removes_a_lock_a_compiler_takes_after_the_check(tmp_path, monkeypatch):
    cache = ProgramCache(CacheSettings(root=tmp_path / "cache"))
    key = "a" * 32
    with cache.local.lock(key, timeout=0):  # a compiler that took it just after cleanup looked
        with monkeypatch.context() as patched:
            patched.setattr(LocalCache, "is_locked", lambda self, key: False)
            assert cleanup(cache, dry_run=False) == []
        assert cache.local.lock_owner(key) is not None
        with pytest.raises(CacheLockTimeout):
            cache.local.try_lock(key, timeout=0)  # still the one lock of the key
    assert cleanup(cache, dry_run=False) == [f"stale lock {key}"]  # free now: removed
    assert not cache.local.lock_path(key).exists()


def test_a_lock_file_removed_while_a_compiler_waits_is_taken_anew(tmp_path, monkeypatch):
    local, key = LocalCache(tmp_path), "b" * 32
    held = local.try_lock(key, timeout=0)
    waiting = threading.Event()

    class Clock:  # the waiter's clock: says when it is waiting for the lock
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            waiting.set()
            time.sleep(seconds)

    monkeypatch.setattr(local_module, "time", Clock())
    taken = {}
    waiter = threading.Thread(target=lambda: taken.update(handle=local.try_lock(key, timeout=30)))
    waiter.start()
    wait_until(waiting.is_set, 30, "the second compiler waits for the lock")
    # What cleanup does holding the lock: remove its files, then let go.
    local.lock_path(key).with_suffix(".owner").unlink()
    local.lock_path(key).unlink()
    held.close()
    waiter.join(30)
    handle = taken["handle"]
    assert os.fstat(handle.fileno()).st_ino == local.lock_path(key).stat().st_ino
    with pytest.raises(CacheLockTimeout):
        local.try_lock(key, timeout=0)  # the waiter's lock excludes a newcomer
    local.unlock(key, handle)
