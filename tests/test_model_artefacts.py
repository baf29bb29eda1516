"""The bundled model on a fresh machine (fetched from the remote store, verified, else converted),
and the CPU target that compiled programs carry: in their keys and metadata, so an entry built
for another CPU is never found here."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cache_worker import fake_compile
from tests.helpers import TINY_CACHE_CONFIG, tiny_arch
from vllm_aot.cache import keys, registry
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.cache.registry import select_configuration
from vllm_aot.loading import prebuilt
from vllm_aot.models import prepare
from vllm_aot.runtime.programs import all_program_keys

TIER_LOGGER = "vllm_aot.cache.remote_tier"

ROOT = Path(__file__).resolve().parents[1]
VERSION = prepare.FORMAT_VERSION  # of the conversion, in a prepared directory's marker


@pytest.fixture(autouse=True)
def empty_cache_root(tmp_path, monkeypatch) -> None:
    """No kernels library, model or vLLM records from this machine's own caches."""
    monkeypatch.setenv("VLLM_AOT_CACHE_DIR", str(tmp_path / "cache-root"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))


@pytest.fixture(scope="module")
def digest() -> str:
    """The prepared digest of the installed GGUF."""
    return prepare.prepared_digest(prepare.find_default_gguf())


def cache_for(tmp_path: Path, **settings) -> ProgramCache:
    url = f"file://{tmp_path / 'store'}"
    return ProgramCache(CacheSettings(root=tmp_path / "compiled", remote_url=url, **settings))


def fake_prepared(models_root: Path, marker: dict) -> Path:
    """A prepared directory as a machine that converted the GGUF has it (a stand-in config)."""
    model_dir = prepare.default_model_dir(models_root)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model_dir / prepare.MARKER).write_text(json.dumps(marker))
    return model_dir


def refuse_converting(monkeypatch) -> None:
    def convert(gguf_path, out_dir):
        raise AssertionError("converted the GGUF although the remote store has the model")

    monkeypatch.setattr(prepare, "_convert_gguf", convert)


def test_a_fresh_machine_fetches_the_prepared_model(digest, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "converted-here"))
    source = fake_prepared(
        tmp_path / "converted-here", {"format_version": VERSION, "digest": digest}
    )
    assert prebuilt.bundled_model(cache_for(tmp_path, upload=True)) == (source, "local")
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "fresh"))
    refuse_converting(monkeypatch)
    model_dir, origin = prebuilt.bundled_model(cache_for(tmp_path))
    assert origin == "remote" and prepare.is_prepared(model_dir, digest)
    for name in ("config.json", prepare.MARKER):
        assert (model_dir / name).read_bytes() == (source / name).read_bytes()
    assert prebuilt.bundled_model(cache_for(tmp_path)) == (model_dir, "local")


def test_a_corrupted_remote_model_is_ignored_and_converted_here(
    digest, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "converted-here"))
    fake_prepared(tmp_path / "converted-here", {"format_version": VERSION, "digest": digest})
    prebuilt.bundled_model(cache_for(tmp_path, upload=True))
    (tmp_path / "store" / f"artefacts/models/{digest}/config.json").write_text("{}")
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(
        prepare, "_convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}")
    )
    with caplog.at_level(logging.WARNING):
        model_dir, origin = prebuilt.bundled_model(cache_for(tmp_path))
    assert origin == "converted" and prepare.is_prepared(model_dir, digest)
    ours = [r for r in caplog.records if r.levelname == "WARNING" and r.name != TIER_LOGGER]
    assert len(ours) == 1 and "unusable" in ours[0].getMessage()
    assert "corrupted" in caplog.text  # the remote tier's refusal names the file
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [
        model_dir.name,
        f"{model_dir.name}.lock",
    ]


def test_an_interrupted_conversion_leaves_nothing_that_looks_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "models"))

    def killed(gguf_path, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "_convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_default_model()
    target = prepare.default_model_dir()
    assert not target.exists() and not list(target.parent.glob(".*"))


def test_vllms_model_records_travel_through_the_store(tmp_path, monkeypatch):
    record = '{"hash": "d0", "modelinfo": {"architecture": "LlamaForCausalLM"}}'
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-here"))
    made = tmp_path / "vllm-here" / "modelinfos" / "vllm-model_executor-models-llama.json"
    made.parent.mkdir(parents=True)
    made.write_text(record)
    assert prebuilt.ensure_model_infos(cache_for(tmp_path, upload=True)) == "local"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-fresh"))
    assert prebuilt.ensure_model_infos(cache_for(tmp_path)) == "remote"
    fetched = tmp_path / "vllm-fresh" / "modelinfos" / made.name
    assert fetched.read_text() == record


# -- the CPU target of compiled programs -----------------------------------------------------------


def fill_as(target: str, cache: ProgramCache, log: Path, monkeypatch) -> None:
    """Compile (fake) and upload every program as a machine of CPU target `target` would."""
    with monkeypatch.context() as patched:
        patched.setattr(keys, "cpu_target", lambda: target)
        patched.setattr(registry, "cpu_target", lambda: target)
        cache.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))


def test_cache_entries_record_their_cpu_target_and_another_targets_are_never_found(
    tmp_path, monkeypatch
):
    here = keys.cpu_target()
    shared = f"file://{tmp_path / 'store'}"  # one store, two machines
    other = ProgramCache(CacheSettings(root=tmp_path / "other", remote_url=shared, upload=True))
    fill_as("x86_64-other", other, tmp_path / "other.log", monkeypatch)
    local = ProgramCache(CacheSettings(root=tmp_path / "here", remote_url=shared, upload=True))
    program_keys = all_program_keys(TINY_CACHE_CONFIG)
    # The other machine's programs are in the store, under keys this machine never computes.
    assert local.missing(tiny_arch(), TINY_CACHE_CONFIG) == program_keys
    entries = local.registry.entries(keys.arch_digest(tiny_arch()))
    assert [e.target for e in entries] == ["x86_64-other"]
    assert "target x86_64-other (here " in entries[0].incompatibility
    assert select_configuration(entries, {}, num_cores=2)[0] is None
    # So this machine compiles its own, and every entry's metadata names the target it is for.
    log = tmp_path / "here.log"
    outcome = local.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(log, 0.0))
    assert set(outcome.sources.values()) == {"compiled"}
    for key in local.local.entry_keys():
        assert local.local.read_meta(key)["fingerprint"]["target"] == here
    fresh = ProgramCache(CacheSettings(root=tmp_path / "fresh", remote_url=shared))
    outcome = fresh.ensure(tiny_arch(), TINY_CACHE_CONFIG, compile_fn=None)
    assert set(outcome.sources.values()) == {"remote"}
    for key in fresh.local.entry_keys():
        assert fresh.local.read_meta(key)["fingerprint"]["target"] == here


def test_the_cpu_target_is_inductors_pick_without_compiling_a_probe(tmp_path):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    probed = f"{platform.machine()}-{pick_vec_isa() or 'novec'}"  # Inductor's own, with g++
    script = "from vllm_aot.cache.keys import cpu_target; print(cpu_target())"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == probed
    assert not list(tmp_path.rglob("*.so")), "computing the target compiled a probe"
