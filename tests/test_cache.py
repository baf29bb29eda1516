"""The compile cache: keys, locking across processes, crashes, corruption, failures, remote stores,
the registry and selection. Programs are built by a fake compiler (bytes, a sleep), so these tests
exercise the cache, not Inductor; test_export covers the real compiler through the same cache."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tests.cache_worker import fake_compile
from tests.helpers import TINY_CACHE_CONFIG, tiny_arch, wait_until
from vllm_aot.cache import registry as registry_module
from vllm_aot.cache.admin import cleanup, status, sync
from vllm_aot.cache.local import CacheLockTimeout
from vllm_aot.cache.program_cache import CacheMissError, CacheSettings, ProgramCache
from vllm_aot.cache.registry import CompiledConfiguration, describe_rows, select_configuration
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import all_program_keys

ROOT = Path(__file__).resolve().parents[1]
NAMES = sorted(k.name for k in all_program_keys(TINY_CACHE_CONFIG))


def make_cache(root: Path, **settings) -> ProgramCache:
    return ProgramCache(CacheSettings(root=root, **settings))


def fill(cache: ProgramCache, log: Path, seconds: float = 0.0, config=TINY_CACHE_CONFIG):
    return cache.ensure(tiny_arch(), config, compile_fn=fake_compile(log, seconds))


def compiled_names(log: Path) -> list[str]:
    return sorted(line.split()[0] for line in log.read_text().splitlines()) if log.exists() else []


def start_worker(root: Path, log: Path, seconds: float, remote: str | None = None):
    args = [sys.executable, "-m", "tests.cache_worker", str(root), str(log), str(seconds)]
    return subprocess.Popen(
        args + ([remote] if remote else []), cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_key_is_the_same_for_other_directories_users_and_hosts(tmp_path):
    script = textwrap.dedent(
        """
        import getpass, json, socket, sys
        socket.gethostname = lambda: sys.argv[1]
        getpass.getuser = lambda: sys.argv[1]
        from tests.helpers import TINY_CACHE_CONFIG, tiny_arch, wait_until
        from vllm_aot.cache.keys import program_cache_key
        from vllm_aot.runtime.programs import all_program_keys
        keys = [program_cache_key(tiny_arch(), TINY_CACHE_CONFIG, k)
                for k in all_program_keys(TINY_CACHE_CONFIG)]
        print(json.dumps(keys))
        """
    )
    keys = []
    for who in ("alice-laptop", "build-host-7"):
        home = tmp_path / who
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "VLLM_AOT_CACHE_DIR": str(home / "cache"),
            "USER": who,
            "PYTHONPATH": str(ROOT),
        }
        out = subprocess.run(
            [sys.executable, "-c", script, who],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        keys.append(json.loads(out.stdout))
    assert keys[0] == keys[1] and len(set(keys[0])) == len(NAMES)


@pytest.mark.unit
def test_keys_change_with_what_changes_the_program():
    from vllm_aot.cache.keys import program_cache_key

    key = all_program_keys(TINY_CACHE_CONFIG)[0]
    base = program_cache_key(tiny_arch(), TINY_CACHE_CONFIG, key)
    bf16 = TINY_CACHE_CONFIG.__class__(**{**TINY_CACHE_CONFIG.to_dict(), "dtype": "bfloat16"})
    assert program_cache_key(tiny_arch(), bf16, key) != base
    assert program_cache_key(tiny_arch(hidden_size=128), TINY_CACHE_CONFIG, key) != base
    # Names do not matter: a fine-tune under another architecture name shares the program.
    renamed = tiny_arch(architecture="MistralForCausalLM")
    assert program_cache_key(renamed, TINY_CACHE_CONFIG, key) == base


@pytest.mark.unit
def test_every_runtime_field_says_whether_programs_are_keyed_by_it():
    """Each RuntimeConfig field is declared `keyed` (programs read it: every cache key holds
    it) or `unkeyed`, so a new field cannot be left out of the keys by forgetting it."""
    from dataclasses import fields

    from vllm_aot.cache.keys import program_fingerprint
    from vllm_aot.runtime.config import KEYS_PROGRAMS, RuntimeConfig

    marks = {f.name: f.metadata.get(KEYS_PROGRAMS) for f in fields(RuntimeConfig)}
    unmarked = [name for name, mark in marks.items() if mark not in (True, False)]
    assert not unmarked, (
        f"declare these RuntimeConfig fields keyed(...) or unkeyed(...): {unmarked}"
    )
    key = all_program_keys(TINY_CACHE_CONFIG)[0]
    runtime = program_fingerprint(tiny_arch(), TINY_CACHE_CONFIG, key)["runtime"]
    assert set(runtime) == {name for name, mark in marks.items() if mark}
    assert "dtype" in runtime and "max_num_seqs" not in runtime


@pytest.mark.unit
def test_an_encode_program_is_keyed_by_its_attention_window():
    """encode_t512 in windows of 64 and of 256 take masks of other shapes: one must never be
    served for the other. Windows run from 64 to the smallest power of two holding
    max_model_len, those dividing the bucket."""
    from vllm_aot.cache.keys import program_cache_key
    from vllm_aot.runtime.config import RuntimeConfig
    from vllm_aot.runtime.programs import ProgramKey, ProgramKind

    config = RuntimeConfig(runner="pooling", max_model_len=256)
    assert config.encode_windows(512) == (64, 128, 256)
    assert config.encode_windows(32) == (32,)
    assert RuntimeConfig(runner="pooling", max_model_len=512).encode_windows(512)[-1] == 512
    keys = {
        program_cache_key(tiny_arch(), config, ProgramKey(ProgramKind.ENCODE, 512, window=w))
        for w in (64, 256)
    }
    assert len(keys) == 2


def test_two_processes_compile_each_program_once(tmp_path):
    log = tmp_path / "compiled.log"
    workers = [start_worker(tmp_path / "cache", log, 1.0) for _ in range(2)]
    results = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert compiled_names(log) == NAMES  # each program built once, by one of them
    for sources in results:
        assert sorted(sources) == NAMES
    built = [name for sources in results for name, s in sources.items() if s == "compiled"]
    assert sorted(built) == NAMES


def test_a_killed_compiler_leaves_nothing_loadable_and_no_blocking_lock(tmp_path, caplog):
    root, log = tmp_path / "cache", tmp_path / "compiled.log"
    victim = start_worker(root, log, 600.0)
    cache = make_cache(root, lock_timeout=5)
    # Killed while compiling: every program it builds has its (live) staging directory.
    staging = lambda: len(list((root / "entries").glob(".staging-*"))) == len(NAMES)
    wait_until(staging, 120, "the worker compiling every program", interval=0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert cache.local.entry_keys() == []
    assert len(cache.local.abandoned_staging()) == len(NAMES)  # half-built, invisible
    caplog.set_level(logging.INFO, logger="vllm_aot.cache")
    outcome = fill(cache, log)
    messages = [r.getMessage() for r in caplog.records]
    # A dead process's lock is taken over on the first try, never waited for.
    assert sum("left locked by dead" in m for m in messages) == len(NAMES), messages
    assert not any("other processes are compiling" in m for m in messages), messages
    assert sorted(outcome.names("compiled")) == NAMES
    assert cache.local.abandoned_staging() == []
    assert not any(lock.held for lock in status(cache).locks)


@pytest.mark.unit
def test_a_corrupted_entry_is_detected_and_rebuilt(tmp_path):
    cache, log = make_cache(tmp_path / "cache"), tmp_path / "compiled.log"
    first = fill(cache, log)
    victim = next(iter(first.paths.values()))
    victim.write_bytes(b"garbage" + victim.read_bytes()[7:])
    again = fill(cache, log)
    assert again.names("compiled") == [next(iter(first.paths)).name]
    assert len(again.names("local")) == len(NAMES) - 1


@pytest.mark.unit
def test_a_failed_compile_is_recorded_and_retried(tmp_path):
    cache, log = make_cache(tmp_path / "cache"), tmp_path / "compiled.log"

    def broken(jobs, on_done):
        raise RuntimeError("g++ exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        cache.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=broken)
    failed = status(cache).failed
    assert sorted(f["name"] for f in failed) == NAMES and "exploded" in failed[0]["error"]
    assert cache.local.entry_keys() == [] and cache.local.abandoned_staging() == []
    assert sorted(fill(cache, log).names("compiled")) == NAMES  # not poisoned
    assert status(cache).failed == []


@pytest.mark.unit
def test_waiting_for_a_held_lock_times_out_naming_the_holder(tmp_path):
    cache = make_cache(tmp_path / "cache", lock_timeout=1)
    from vllm_aot.cache.keys import program_cache_key

    key = program_cache_key(tiny_arch(), TINY_CACHE_CONFIG, all_program_keys(TINY_CACHE_CONFIG)[0])
    other = make_cache(tmp_path / "cache").local  # another open file: flock conflicts
    handle = other.try_lock(key, timeout=0)
    try:
        with pytest.raises(CacheLockTimeout, match=rf"pid {os.getpid()} on .* is building"):
            fill(cache, tmp_path / "compiled.log")
    finally:
        other.unlock(key, handle)
    assert len(cache.local.entry_keys()) == len(NAMES) - 1  # the others were built meanwhile


@pytest.mark.unit
def test_require_cached_refuses_naming_the_cached_configurations(tmp_path):
    cache = make_cache(tmp_path / "cache")
    fill(cache, tmp_path / "compiled.log")
    other = TINY_CACHE_CONFIG.__class__(
        **{**TINY_CACHE_CONFIG.to_dict(), "max_num_seqs": 4, "decode_batch_buckets": (4,)}
    )
    assert cache.missing(tiny_arch(), other)
    with pytest.raises(CacheMissError) as refused:
        cache.ensure(tiny_arch(), other, compile_fn=None)
    message = str(refused.value)
    assert "decode_b4_c256" in message and "--require-cached" in message
    assert "2 | 256 | 16 | 64 | float32" in message  # the cached configuration's row


def remote_round_trip(tmp_path: Path, url: str) -> None:
    log = tmp_path / "compiled.log"
    builder = make_cache(tmp_path / "builder", remote_url=url, upload=True)
    assert sorted(fill(builder, log).names("compiled")) == NAMES
    fresh = make_cache(tmp_path / "fresh", remote_url=url)
    assert fresh.missing(tiny_arch(), TINY_CACHE_CONFIG) == []
    outcome = fresh.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=None)
    assert sorted(outcome.names("remote")) == NAMES and compiled_names(log) == NAMES
    for path in outcome.paths.values():
        assert path.read_bytes() == builder.local.lookup(path.parent.name).read_bytes()
    assert [e.location for e in fresh.registry.entries(builder_arch_digest())] == ["local"]
    # A third machine sees the configuration in the registry before fetching anything.
    third = make_cache(tmp_path / "third", remote_url=url)
    entries = third.registry.entries(builder_arch_digest())
    assert len(entries) == 1 and entries[0].location == url.rstrip("/")


def builder_arch_digest() -> str:
    from vllm_aot.cache.keys import arch_digest

    return arch_digest(tiny_arch())


@pytest.mark.unit
def test_remote_directory_store(tmp_path):
    remote_round_trip(tmp_path, f"file://{tmp_path / 'shared'}")


@pytest.fixture
def s3_server(monkeypatch):
    """A real S3-compatible server (moto) on a loopback port, with one bucket."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    from vllm_aot.testing import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for name, value in (
        ("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(name, value)
    boto3.client("s3").create_bucket(Bucket="compiled")
    yield "s3://compiled/team/vllm-aot"
    server.stop()


def test_remote_s3_store(tmp_path, s3_server):
    remote_round_trip(tmp_path, s3_server)


@pytest.mark.unit
def test_sync_pushes_and_pulls(tmp_path):
    url = f"file://{tmp_path / 'shared'}"
    builder = make_cache(tmp_path / "builder", remote_url=url)
    fill(builder, tmp_path / "compiled.log")
    assert sync(builder, push=True, pull=False) == (len(NAMES), 0)
    fresh = make_cache(tmp_path / "fresh", remote_url=url)
    assert sync(fresh, push=False, pull=True) == (0, len(NAMES))
    assert fresh.missing(tiny_arch(), TINY_CACHE_CONFIG) == []
    assert len(fresh.registry.local_entries()) == 1


@pytest.mark.unit
def test_cleanup_removes_failures_stale_locks_and_other_versions(tmp_path):
    cache, log = make_cache(tmp_path / "cache"), tmp_path / "compiled.log"
    fill(cache, log)
    old = cache.local.entry_keys()[0]
    meta_path = cache.local.entry_dir(old) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"]["torch"] = "2.0.0"
    meta_path.write_text(json.dumps(meta))
    cache.local.record_failure("f" * 32, "decode_b9_c256", "boom")
    (cache.local.locks_dir / ("s" * 32 + ".lock")).touch()
    planned = cleanup(cache, dry_run=True)
    assert any("failed record" in p for p in planned)
    assert any("stale lock" in p for p in planned)
    assert any(f"entry {old} (torch 2.0.0" in p for p in planned)
    assert cleanup(cache, dry_run=False) == planned
    assert cleanup(cache, dry_run=True) == []
    assert len(cache.local.entry_keys()) == len(NAMES) - 1


def _entry(tp=1, batch=8, length=2048, dtype="bfloat16", torch_version=None, created=0.0):
    from vllm_aot.cache.keys import cpu_target, generator_source_digest, versions

    config = RuntimeConfig(
        max_num_seqs=batch, max_model_len=length, dtype=dtype, tensor_parallel_size=tp
    )
    return CompiledConfiguration(
        arch_digest="a",
        architecture="LlamaForCausalLM",
        runtime=config.shape_fields(),
        target=cpu_target(),
        torch=torch_version or versions()["torch"],
        vllm_aot=versions()["vllm_aot"],
        created=created,
        source=generator_source_digest(),
    )


@pytest.mark.unit
def test_selection_prefers_tp_then_batch_then_length_among_exact_matches():
    entries = [
        _entry(batch=32, length=1024),
        _entry(batch=8, length=4096),
        _entry(batch=32, length=2048),
        _entry(tp=2, batch=4),
        _entry(batch=64, torch_version="1.0"),
    ]
    best, why = select_configuration(entries, {}, num_cores=2)
    assert best.tensor_parallel_size == 2 and "largest TP" in why
    best, _ = select_configuration(entries, {}, num_cores=1)  # TP 2 does not fit one core
    assert (best.runtime["max_num_seqs"], best.runtime["max_model_len"]) == (32, 2048)
    best, why = select_configuration(entries, {"max_model_len": 4096}, num_cores=2)
    assert best.runtime["max_num_seqs"] == 8 and "max_model_len=4096" in why
    best, why = select_configuration(entries, {"dtype": "float32"}, num_cores=2)
    assert best is None and "none of 5 cached configurations" in why


@pytest.mark.unit
def test_records_of_programs_from_other_code_are_not_served():
    """A record written by other program-generating code names programs this code never loads:
    selection passes over it and says why in the lookup."""
    stale = replace(_entry(batch=32), source="0123456789abcdef")
    current = _entry(batch=8)
    assert "source 0123456789abcdef (here " in stale.incompatibility
    assert current.incompatibility is None
    best, _ = select_configuration([stale, current], {}, num_cores=2)
    assert best is current
    assert "(not loadable here)" in describe_rows([stale])[1][-2]


@pytest.mark.unit
def test_records_of_the_same_shapes_from_two_codes_live_side_by_side(tmp_path, monkeypatch):
    """The same shapes compiled by other program-generating code and by this code: two records,
    so neither code's programs stop being found when the other one starts."""
    cache = make_cache(tmp_path / "cache")
    log = tmp_path / "compiled.log"
    monkeypatch.setattr(registry_module, "generator_source_digest", lambda: "0123456789abcdef")
    fill(cache, log)
    monkeypatch.undo()
    fill(cache, log)  # a warm start (the fake programs' keys do not name the code)
    entries = cache.registry.local_entries()
    assert sorted(e.incompatibility is None for e in entries) == [False, True]
    assert len({e.name for e in entries}) == 2 and len({e.source for e in entries}) == 2
    fill(cache, log)  # a warm start of this code again writes nothing new
    assert len(cache.registry.local_entries()) == 2


@pytest.mark.unit
def test_selection_takes_the_newest_of_equal_shapes():
    """Equal TP, batch and length differ in their buckets: the one compiled last is served."""
    older, newer = _entry(batch=32, created=1.0), _entry(batch=32, created=2.0)
    older.runtime["prefill_context_buckets"] = [256, 2048]
    newer.runtime["prefill_context_buckets"] = [256, 1024, 2048]
    for entries in ([older, newer], [newer, older]):
        best, why = select_configuration(entries, {}, num_cores=2)
        assert best is newer and "then newest" in why
