"""A full disk while programs compile in worker processes: in a child (an OSError, or the C++
compiler saying so) or while committing on a worker's thread, the start fails with
`CacheDiskFullError`, no child is left running, and the next start compiles only what is missing
(docs/faults.md). The children are the real `python -m vllm_aot.runtime.compiler`, with export
and AOTInductor replaced by a stand-in that writes bytes or finds the disk full."""

from __future__ import annotations

import errno
import os
import sys
import types
from pathlib import Path

import pytest

from tests.cache_worker import fake_compile
from tests.helpers import TINY_CACHE_CONFIG, children_of, cmdline_of, tiny_arch
from vllm_aot.cache import local as local_module
from vllm_aot.cache.program_cache import CacheDiskFullError, CacheSettings, ProgramCache
from vllm_aot.runtime import compiler
from vllm_aot.runtime.programs import all_program_keys

NAMES = sorted(k.name for k in all_program_keys(TINY_CACHE_CONFIG))

# Run as `python SHIM -m vllm_aot.runtime.compiler JOBFILE`; FAKE_COMPILE says what a compile does.
SHIM = """
import errno, os, runpy, sys
from pathlib import Path

import torch, torch._inductor, torch.export


def package(exported, package_path):
    how = os.environ["FAKE_COMPILE"]
    if how == "oserror":
        raise OSError(errno.ENOSPC, "No space left on device", package_path)
    if how == "cxx":
        raise RuntimeError("C++ compile error: final link failed: No space left on device")
    Path(package_path).write_bytes(b"built")
    return package_path


torch.export.export = lambda *args, **kwargs: None
torch._inductor.aoti_compile_and_package = package
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Worker processes whose compiles do what `FAKE_COMPILE` says (set it in the test)."""
    shim = tmp_path / "shim.py"
    shim.write_text(SHIM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {shim} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(compiler, "sys", types.SimpleNamespace(executable=str(python)))


def compiler_children() -> list:
    """This process's compile workers (other tests may leave servers of their own under it)."""
    return [
        p
        for p in children_of(os.getpid())
        if "vllm_aot.runtime.compiler" in " ".join(cmdline_of(p))
    ]


def two_workers(jobs, on_done) -> None:
    compiler.compile_programs(jobs, tiny_arch(), TINY_CACHE_CONFIG, num_workers=2, on_done=on_done)


def assert_the_next_start_compiles_the_rest(root: Path, log: Path, num_committed: int) -> None:
    assert not compiler_children()  # every worker was stopped and reaped
    assert not list((root / "entries").glob(".staging-*"))
    again = ProgramCache(CacheSettings(root=root, lock_timeout=0))  # no lock left held
    outcome = again.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))
    assert len(outcome.names("local")) == num_committed
    assert sorted(outcome.names("local") + outcome.names("compiled")) == NAMES


@pytest.mark.parametrize("how", ["oserror", "cxx"])
def test_a_full_disk_in_a_worker_process_is_cache_disk_full(tmp_path, monkeypatch, stand_in, how):
    monkeypatch.setenv("FAKE_COMPILE", how)
    root = tmp_path / "cache"
    with pytest.raises(CacheDiskFullError, match=f"no space left .* {root}"):
        ProgramCache(CacheSettings(root=root)).ensure(
            tiny_arch(), TINY_CACHE_CONFIG, compile_fn=two_workers
        )
    assert_the_next_start_compiles_the_rest(root, tmp_path / "log", 0)


def test_a_full_disk_committing_on_a_worker_thread_is_cache_disk_full(
    tmp_path, monkeypatch, stand_in
):
    monkeypatch.setenv("FAKE_COMPILE", "write")
    real, calls = local_module.write_json_atomic, []

    def fills_after_one(path, *args, **kwargs):
        if path.name == "meta.json":  # a commit's (a lock's owner file is written as well)
            calls.append(path)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(local_module, "write_json_atomic", fills_after_one)
    root = tmp_path / "cache"
    with pytest.raises(CacheDiskFullError, match=f"no space left .* {root}"):
        ProgramCache(CacheSettings(root=root)).ensure(
            tiny_arch(), TINY_CACHE_CONFIG, compile_fn=two_workers
        )
    monkeypatch.setattr(local_module, "write_json_atomic", real)  # space is freed
    assert_the_next_start_compiles_the_rest(root, tmp_path / "log", 1)


@pytest.mark.unit
def test_a_full_disk_compiling_in_this_process_is_enospc(monkeypatch):
    def compile_program(key, arch, config, path):
        raise RuntimeError("C++ compile error: final link failed: No space left on device")

    monkeypatch.setattr(compiler, "compile_program", compile_program)
    key = all_program_keys(TINY_CACHE_CONFIG)[0]
    with pytest.raises(OSError, match=f"No space left on device while compiling {key.name}") as e:
        compiler.compile_programs(
            [(key, Path("p.pt2"))], tiny_arch(), TINY_CACHE_CONFIG, num_workers=1
        )
    assert e.value.errno == errno.ENOSPC
