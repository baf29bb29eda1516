"""The kernels library on a machine: a build killed midway never blocks the next start, and a
fresh machine installs the library from the remote store (verified) instead of building it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import needs_kernels
from vllm_aot import kernels
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.cache.remote_artefacts import MANIFEST, artefact_name
from vllm_aot.cache.remote_tier import META_SUFFIX
from vllm_aot.files import file_sha256
from vllm_aot.loading.prebuilt import sync_artefacts

TIER_LOGGER = "vllm_aot.cache.remote_tier"

pytestmark = needs_kernels

ROOT = Path(__file__).resolve().parents[1]
LOAD = "from vllm_aot import kernels; print(kernels.load())"


def python(script: str, cache_root: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_AOT_CACHE_DIR": str(cache_root)}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def installed() -> Path:
    """This machine's library directory (built once if it has none)."""
    kernels.load()
    assert kernels.installed_library() is not None, "a build must install what the next load finds"
    return kernels.library_dir()


@pytest.fixture
def store(tmp_path, monkeypatch) -> ProgramCache:
    """A cache whose remote store is a shared directory; no bundled model or vLLM records."""
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "no-models"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "no-vllm-cache"))
    url = f"file://{tmp_path / 'store'}"
    return ProgramCache(CacheSettings(root=tmp_path / "compiled", remote_url=url))


def test_a_torch_build_lock_beside_a_whole_library_does_not_block_loading(installed, tmp_path):
    root = tmp_path / "cache"
    directory = root / "kernels" / installed.name
    shutil.copytree(installed, directory)
    # What torch's builder leaves when killed midway: its baton `lock`, which it waits on forever.
    os.close(os.open(directory / "lock", os.O_CREAT | os.O_EXCL))
    out = python(LOAD, root, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "installed"


@pytest.mark.slow  # a whole second build of the kernels (2-3 minutes)
def test_a_kernel_build_killed_midway_does_not_block_the_next_start(tmp_path):
    root = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_AOT_CACHE_DIR": str(root)}
    builder = subprocess.Popen(
        [sys.executable, "-c", LOAD],
        env=env,
        start_new_session=True,  # its own group: the kill takes ninja and g++ with it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not list(root.rglob("lock")):  # torch's baton: the compiler is running
        assert builder.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    started = time.monotonic()
    out = python(LOAD, root, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "built"
    print(f"loaded {time.monotonic() - started:.1f} s after a build killed midway")
    assert [p.name for p in (root / "kernels").iterdir() if p.is_dir()] == [
        kernels.build_digest()
    ], "the killed build's staging directory was not removed"
    assert not list(root.rglob("lock"))


def _push_library(installed: Path, store: ProgramCache, tmp_path: Path, monkeypatch) -> Path:
    """A machine that has the library uploads it; returns the artefact's directory in the store."""
    monkeypatch.setenv("VLLM_AOT_CACHE_DIR", str(tmp_path / "builder"))
    shutil.copytree(installed, kernels.library_dir())
    assert sync_artefacts(store, push=True, pull=False) == (1, 0)
    assert sync_artefacts(store, push=True, pull=False) == (0, 0)  # the store has it
    return tmp_path / "store" / artefact_name("kernels", kernels.build_digest())


def test_a_fresh_machine_installs_the_library_from_the_remote_store(
    installed, store, tmp_path, monkeypatch
):
    _push_library(installed, store, tmp_path, monkeypatch)
    monkeypatch.setenv("VLLM_AOT_CACHE_DIR", str(tmp_path / "fresh"))
    assert kernels.installed_library() is None
    assert sync_artefacts(store, push=False, pull=True) == (0, 1)
    assert kernels.installed_library() is not None
    # Fetched, not built: only the library and its record, no build files.
    fetched = {p.name for p in kernels.library_dir().iterdir()}
    assert fetched == {kernels.LIBRARY_FILE, kernels.RECORD_FILE}


def _rewrite(artefact: Path, file: str, edit) -> None:
    """Change a stored file and its meta consistently (a writer that lies; no signing key)."""
    path = artefact / file
    path.write_bytes(edit(path.read_bytes()))
    meta = artefact / (file + META_SUFFIX)
    recorded = json.loads(meta.read_text())
    recorded.update(sha256=file_sha256(path), bytes=path.stat().st_size)
    meta.write_text(json.dumps(recorded))


def _escaping(manifest: bytes) -> bytes:
    files = json.loads(manifest)["files"]
    return json.dumps(
        {"files": ["../../../escaped" if f == kernels.RECORD_FILE else f for f in files]}
    ).encode()


def _another_build(record: bytes) -> bytes:
    return json.dumps({**json.loads(record), "digest": "0" * 16}).encode()


@pytest.mark.parametrize("damage", ["bytes", "record of another build", "traversal name"])
def test_an_unusable_remote_library_is_a_miss_with_one_warning(
    damage, installed, store, tmp_path, monkeypatch, caplog
):
    artefact = _push_library(installed, store, tmp_path, monkeypatch)
    if damage == "bytes":
        library = artefact / kernels.LIBRARY_FILE
        raw = bytearray(library.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        library.write_bytes(bytes(raw))
    elif damage == "record of another build":
        _rewrite(artefact, kernels.RECORD_FILE, _another_build)
    else:
        _rewrite(artefact, MANIFEST, _escaping)
    monkeypatch.setenv("VLLM_AOT_CACHE_DIR", str(tmp_path / "fresh"))
    assert sync_artefacts(store, push=False, pull=True) == (0, 0)
    assert kernels.installed_library() is None
    assert not (tmp_path / "escaped").exists()
    assert not list((tmp_path / "fresh" / "kernels").glob(".*-*"))  # no staging left behind
    # One warning of ours naming the artefact (the remote tier adds its own refusal and its
    # once-per-process note that no signing key is set).
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name != TIER_LOGGER]
    assert len(warnings) == 1 and "unusable" in warnings[0].getMessage()


def test_a_start_loads_the_fetched_library_and_says_where_it_came_from(
    installed, store, tmp_path, monkeypatch
):
    _push_library(installed, store, tmp_path, monkeypatch)
    script = textwrap.dedent(
        f"""
        import torch
        from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
        from vllm_aot.loading.prebuilt import ensure_kernels
        cache = ProgramCache(CacheSettings(root={str(tmp_path / "compiled")!r},
                                           remote_url={store.settings.remote_url!r}))
        print(ensure_kernels(cache, ["bf16"]))
        x, w = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
        print(torch.ops.vllm_aot.linear_bf16(x, w).shape)
        """
    )
    out = python(script, tmp_path / "fresh", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["remote", "torch.Size([3, 32])"]
