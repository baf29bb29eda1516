"""Export -> load round trip with the inductor backend (AOTInductor packages), and refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import needs_kernels, tiny_config
from vllm_aot.cache.keys import cpu_target
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.kernels import program_kernels
from vllm_aot.loading.export_dir import (
    MANIFEST_NAME,
    ArtifactMismatchError,
    export_model,
    read_manifest,
)
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# One bucket of each kind (prefill: a fresh prompt's and one reading the cache): five programs,
# about a minute of compile on two cores.
COMPILED = dict(
    backend="inductor",
    decode_batch_buckets=(4,),
    prefill_token_buckets=(64,),
)
PROMPTS = [[100, 200, 300, 400], list(range(1000, 1050)), [7] * 20]


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory) -> ProgramCache:
    """This module's own compile cache: its first export must compile."""
    return ProgramCache(CacheSettings(root=tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def exported(tiny_model_dirs, tmp_path_factory, export_cache):
    out = tmp_path_factory.mktemp("export") / "tiny-llama"
    cache = export_cache
    report = export_model(tiny_model_dirs("llama"), out, tiny_config(**COMPILED), cache=cache)
    return out, report


def generate(model, prompts=PROMPTS):
    requests = [
        GenerationRequest(p, 10, SamplingParams(temperature=0.7, seed=i))
        for i, p in enumerate(prompts)
    ]
    return [r.token_ids for r in Generator(model).generate(requests)]


def test_export_compiles_every_program_once(exported):
    out, report = exported
    assert sorted(report.compile_seconds) == [
        "decode_b4_c256",
        "greedy_r4",
        "prefill_t64_c0",
        "prefill_t64_c256",
        "sample_r4",
    ]
    assert sorted(p.name for p in (out / "programs").iterdir()) == [
        "decode_b4_c256.pt2",
        "greedy_r4.pt2",
        "prefill_t64_c0.pt2",
        "prefill_t64_c256.pt2",
        "sample_r4.pt2",
    ]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_a_second_export_takes_every_program_from_the_cache(
    exported, export_cache, tiny_model_dir, tmp_path
):
    out, _ = exported
    again = tmp_path / "again"
    report = export_model(tiny_model_dir, again, tiny_config(**COMPILED), cache=export_cache)
    assert report.compile_seconds == {}
    for program in (out / "programs").iterdir():
        assert (again / "programs" / program.name).read_bytes() == program.read_bytes()


def test_exported_directory_loads_without_compiling_and_matches_eager(exported, tiny_model_dir):
    out, _ = exported
    compiled, report = load_model(out, tiny_config(**COMPILED))
    assert report.compiled == {}
    assert len(report.loaded) == 5 and report.count("artifact") == 5
    eager, _ = load_model(tiny_model_dir, tiny_config(**{**COMPILED, "backend": "eager"}))
    assert generate(compiled) == generate(eager)
    ids = list(range(300, 340))
    from vllm_aot.runtime.inputs import PrefillChunk

    torch.testing.assert_close(
        compiled.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3])),
        eager.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3])),
        atol=1e-4,
        rtol=1e-4,
    )
    # prompt logprobs: the compiled head (its logprob kernel) scores given tokens as eager does
    hidden = eager.forward_prefill([PrefillChunk(ids, 0, [1, 2, 3])]).tokens[:-1]
    ours, reference = compiled.score(hidden, ids[1:]), eager.score(hidden, ids[1:])
    assert ours.tokens.tolist() == ids[1:]
    torch.testing.assert_close(ours.token_logprobs, reference.token_logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.top_logprobs, reference.top_logprobs, atol=1e-4, rtol=0)
    # prompt embeddings: the model's own, through the compiled layer programs
    embeds = compiled.embed(torch.tensor(ids))
    torch.testing.assert_close(
        compiled.prefill_logits(PrefillChunk([0] * len(ids), 0, [1, 2, 3], embeds)),
        compiled.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3])),
        atol=0,
        rtol=0,
    )


def test_loading_for_another_configuration_is_refused(exported):
    out, _ = exported
    with pytest.raises(ArtifactMismatchError, match=r"max_num_seqs=4 \(asked 8\)"):
        load_model(
            out, tiny_config(**{**COMPILED, "max_num_seqs": 8, "decode_batch_buckets": (8,)})
        )


def test_loading_an_artifact_from_another_torch_is_refused(exported, tmp_path):
    out, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["torch_version"] = "1.0.0"
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactMismatchError, match=r"torch 1\.0\.0 \(this is 2\.13"):
        load_model(copy)


def _edited_copy(exported, tmp_path, **changes):
    out, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    (copy / MANIFEST_NAME).write_text(json.dumps({**manifest, **changes}))
    return copy


def test_the_manifest_names_the_cpu_target_and_kernels(exported):
    out, _ = exported
    manifest = read_manifest(out)
    assert manifest["cpu_target"] == cpu_target()
    assert manifest["kernels"] == program_kernels(["fp32"])


def test_an_artifact_for_another_cpu_target_is_refused_before_anything_loads(exported, tmp_path):
    copy = _edited_copy(exported, tmp_path, cpu_target="x86_64-avx512")
    expected = rf"CPU target x86_64-avx512 and this machine is {cpu_target()}.*Re-export"
    with pytest.raises(ArtifactMismatchError, match=expected):
        read_manifest(copy)  # what serve's front end reads first
    with pytest.raises(ArtifactMismatchError, match=expected):
        load_model(copy)


def test_an_artifact_calling_other_kernels_is_refused(exported, tmp_path):
    copy = _edited_copy(exported, tmp_path, kernels={"linear": "aten", "attention": "torch"})
    if set(program_kernels(["fp32"]).values()) == {"aten", "torch"}:
        pytest.skip("this machine runs no kernels")
    with pytest.raises(ArtifactMismatchError, match=r"call the kernels .* Re-export"):
        load_model(copy)


def test_an_artifact_of_the_format_before_cpu_targets_is_refused(exported, tmp_path):
    copy = _edited_copy(exported, tmp_path, format=1)
    with pytest.raises(ArtifactMismatchError, match=r"artifact format 1 \(this is 2\)"):
        load_model(copy)


def test_loading_an_export_compiles_nothing_not_even_an_isa_probe(exported, tmp_path):
    out, _ = exported
    script = f"from vllm_aot.loading.startup import load_model; load_model({str(out)!r})"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert not list(tmp_path.rglob("*.so")), "loading compiled Inductor's ISA probe"


def test_a_killed_process_leaves_nothing_of_its_programs_in_the_temporary_directory(
    exported, tmp_path
):
    """A server's engine is killed, never torn down: whatever loading its programs put in the
    temporary directory must be gone once they are loaded (torch's package loader left an
    extracted copy of every program there until its loader was destroyed)."""
    out, _ = exported
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    script = (
        "import os; from vllm_aot.loading.startup import load_model; "
        f"model, _ = load_model({str(out)!r}); os._exit(0)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    assert not list(scratch.iterdir())


@needs_kernels  # without them a program runs under torch's binding, which holds the GIL
def test_other_python_threads_run_while_a_program_runs(exported):
    """A server's engine schedules and streams on one Python thread while its step thread runs
    the programs: a program call must let the GIL go (torch's own binding of the runner holds
    it for the whole call). Python's forced switches are put off (a switch interval of a
    second) so the GIL changes hands only where a thread lets it go: the busy thread at each
    sleep(0), the step thread inside its calls or nowhere."""
    import bisect
    import threading
    import time

    from vllm_aot.runtime.programs import ProgramKind, example_inputs

    out, _ = exported
    model, _ = load_model(out)
    key = next(k for k in model.programs if k.kind is ProgramKind.PREFILL)
    program, args = model.programs[key], list(example_inputs(key, model.arch, model.config))
    calls: list[tuple[float, float]] = []
    ticks: list[float] = []
    done = threading.Event()

    def step_thread():
        for _ in range(20):
            start = time.perf_counter()
            program(*args)
            calls.append((start, time.perf_counter()))
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        thread = threading.Thread(target=step_thread)
        thread.start()
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    inside = sum(bisect.bisect_left(ticks, e) - bisect.bisect_right(ticks, s) for s, e in calls)
    assert inside > 0, f"no Python ran during {len(calls)} program calls"


def test_an_incomplete_export_is_not_loadable(exported, tmp_path):
    out, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "programs" / "decode_b4_c256.pt2").unlink()
    with pytest.raises(FileNotFoundError, match="decode_b4_c256"):
        load_model(copy)
    (copy / MANIFEST_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="not an exported vllm-aot artifact"):
        load_model(copy)


def test_export_refuses_the_eager_backend(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="backend='inductor'"):
        export_model(tiny_model_dir, tmp_path / "x", tiny_config())
