"""A `.gguf` file as the model, by its path: the config its metadata state, the runtime loading it
as it loads its directory, two files of one directory kept apart, the refusals, and vLLM taking
the file as its model (config, tokenizer and chat template from the file, or --tokenizer)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_files import GgmlType, write_gguf
from tests.helpers import tiny_config
from vllm_aot.cache.keys import program_cache_key
from vllm_aot.loading.startup import load_model
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.models.config import RopeSpec
from vllm_aot.models.gguf_config import companion_dir
from vllm_aot.models.source import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.programs import all_program_keys

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPTS = ([1, 450, 4996, 17354, 1701], [1, 3681, 338])
DOWN = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, tiny_model_dirs):
    """family -> `model.gguf` (Q4_1 layers, Q8_0 vocabulary rows, the tokenizer's metadata)
    written from the tiny model of that family, beside config.json and the tokenizer."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"gguf-path-{family}")
            made[family] = write_gguf(tiny_model_dirs(family), out, family=family) / "model.gguf"
        return made[family]

    return get


def greedy(source, config):
    model, _ = load_model(source, config)
    requests = [GenerationRequest(list(p), max_tokens=8, ignore_eos=True) for p in PROMPTS]
    return model.config.weight_formats, [r.token_ids for r in Generator(model).generate(requests)]


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_config_is_the_one_its_model_was_made_from(gguf_files, tiny_model_dirs, family):
    from_file, made_from = load_arch(gguf_files(family)), load_arch(tiny_model_dirs(family))
    # float32 metadata, read as transformers reads them: 1e-5 is 9.9999997e-06
    assert from_file.rms_norm_eps == pytest.approx(made_from.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(from_file, rms_norm_eps=made_from.rms_norm_eps) == made_from


def llama3_factors(arch, factor=8.0, low=1.0, high=4.0, original=8192) -> np.ndarray:
    """`convert_hf_to_gguf.LlamaModel`'s `rope_freqs` of Llama 3's rotary scaling."""
    import math

    factors = []
    for freq in RopeSpec(theta=arch.rope.theta, head_dim=arch.head_dim).inv_freq().tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.unit
def test_rotary_scalings_read_from_the_file_or_refused(tiny_model_dirs, tmp_path):
    """Llama 3's scaling from its `rope_freqs` factors, linear from the metadata; factors of
    another scaling and other scaling types are refused naming ours."""
    hf_dir = tiny_model_dirs("llama")
    arch = load_arch(hf_dir)

    def written(name, extra):
        out = write_gguf(hf_dir, tmp_path / name, family="llama", extra=extra, with_tokenizer=False)
        return out / "model.gguf"

    llama3 = written("llama3", lambda w: w.add_tensor("rope_freqs.weight", llama3_factors(arch)))
    want = RopeSpec(arch.rope.theta, arch.head_dim, "llama3", 8.0, 1.0, 4.0, 8192)
    assert load_arch(llama3).rope == want

    def linear(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    assert load_arch(written("linear", linear)).rope.kind == "linear"
    assert load_arch(written("linear", linear)).rope.factor == 2.0
    other = llama3_factors(arch, original=16384)
    odd = written("odd", lambda w: w.add_tensor("rope_freqs.weight", other))
    with pytest.raises(ValueError, match="rope_freqs factors are not Llama 3's rotary scaling"):
        load_arch(odd)

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load_arch(written("yarn", yarn))


@pytest.mark.unit
def test_the_bundled_file_states_its_directorys_config_exactly(default_model_dir):
    """Same numbers, same digest: the file and its prepared directory share their programs."""
    from vllm_aot.models.gguf import find_gguf

    assert load_arch(find_gguf(default_model_dir)) == load_arch(default_model_dir)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_file_by_path_serves_as_its_directory_does(gguf_files, family):
    """Quantization gguf implied, the same formats, weights and greedy tokens."""
    path = gguf_files(family)
    by_path = greedy(path, tiny_config())
    assert by_path == greedy(path.parent, tiny_config(quantization="gguf"))
    formats = dict(by_path[0])

    def weights(source):
        arch = load_arch(source)
        fmt = lambda name: formats.get(name, formats["*"])
        return load_weights(source, arch, torch.float32, formats=fmt, quantization="gguf")

    a, b = weights(path), weights(path.parent)
    assert all(torch.equal(x, y) for x, y in zip(a.embed.tensors, b.embed.tensors, strict=True))
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


@pytest.mark.unit
def test_two_files_of_one_directory_are_two_models(
    gguf_files, tiny_model_dirs, tmp_path, monkeypatch
):
    path = Path(shutil.copy(gguf_files("llama"), tmp_path / "model.gguf"))
    hf_dir = tiny_model_dirs("llama")
    write_gguf(hf_dir, tmp_path, family="llama", linear_type=GgmlType.Q8_0, file_name="other.gguf")
    other = tmp_path / "other.gguf"
    formats = [resolve_weight_formats(p, "gguf", torch.float32) for p in (path, other)]
    assert formats[0] != formats[1]
    arch = load_arch(path)
    configs = [tiny_config(quantization="gguf", **f._asdict()) for f in formats]
    key = all_program_keys(configs[0])[0]
    assert program_cache_key(arch, configs[0], key) != program_cache_key(arch, configs[1], key)
    from vllm_aot.models import gguf_config

    monkeypatch.setattr(gguf_config, "_write_companion", lambda *args: None)  # no tokenizer
    root = tmp_path / "companions"
    dirs = [companion_dir(p, root) for p in (path, other)]
    assert dirs[0] != dirs[1]
    links = [sorted(p.name for p in d.glob("*.gguf")) for d in dirs]
    assert links == [["model.gguf"], ["other.gguf"]]
    assert companion_dir(path, root) == dirs[0]  # once per file


def write_foreign_gguf(path, architecture: str):
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.unit
def test_an_architecture_we_do_not_run_is_refused_naming_ours(tmp_path):
    path = write_foreign_gguf(tmp_path / "gemma.gguf", "gemma2")
    message = r"GGUF architecture 'gemma2' is not supported; supported: llama, qwen2, qwen3"
    with pytest.raises(ValueError, match=message):
        load_arch(path)
    with pytest.raises(ValueError, match=message):
        load_model(path, tiny_config())


@pytest.mark.unit
def test_a_tensor_type_we_do_not_read_is_refused_naming_ours(tiny_model_dirs, tmp_path):
    types = {name: np.float64 for name in DOWN}
    path = write_gguf(tiny_model_dirs("llama"), tmp_path, family="llama", types=types)
    with pytest.raises(ValueError, match="down_proj is F64; supported types: "):
        load_model(path / "model.gguf", tiny_config())


def test_vllm_aot_serve_refuses_a_file_we_cannot_serve_before_any_server(tmp_path):
    from tests.helpers import run_vllm_aot

    foreign = write_foreign_gguf(tmp_path / "gemma.gguf", "gemma2")
    done = run_vllm_aot("serve", str(foreign), "--backend", "eager", timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: vllm-aot cannot serve {foreign}: gemma.gguf: GGUF architecture 'gemma2' is not "
        "supported; supported: llama, qwen2, qwen3"
    )
    assert "Traceback" not in done.stderr


@pytest.mark.unit
def test_a_file_serves_its_own_blocks_only(gguf_files):
    with pytest.raises(ValueError, match=r"serves quantization gguf .*, not int8"):
        load_model(gguf_files("llama"), tiny_config(quantization="int8"))


# --- vLLM's configuration of a .gguf model ---------------------------------------------------


def engine_config(model, **flags):
    from vllm.engine.arg_utils import EngineArgs

    shapes = dict(max_model_len=256, max_num_batched_tokens=64, block_size=16, dtype="float32")
    args = EngineArgs(model=str(model), additional_config={"backend": "eager"}, **shapes, **flags)
    return args.create_engine_config()


def test_vllm_serves_a_file_with_its_own_tokenizer_or_the_one_given(
    gguf_files, tiny_model_dirs, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from vllm_aot.plugin.options import RESOLVED_KEY, AotOptions

    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "models"))
    path, hf_dir = gguf_files("llama"), tiny_model_dirs("llama")
    config = engine_config(path)
    model_config = config.model_config
    assert model_config.quantization == "gguf"
    assert model_config.served_model_name == str(path)
    assert model_config.model == model_config.tokenizer == str(companion_dir(path))
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert runtime.formats_summary() == "q4_1 (embed_tokens, lm_head: q8_0)"
    ours = AutoTokenizer.from_pretrained(model_config.tokenizer)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    text = "Hello, world! <|im_start|>user\nWhat's 2+2?<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    given = engine_config(path, tokenizer=str(hf_dir)).model_config
    assert given.tokenizer == str(hf_dir) and given.model == model_config.model


def test_vllm_refuses_a_file_we_cannot_serve_in_the_front_end(
    tiny_model_dirs, tmp_path, monkeypatch
):
    monkeypatch.setenv("VLLM_AOT_MODELS_DIR", str(tmp_path / "models"))
    foreign = write_foreign_gguf(tmp_path / "gemma.gguf", "gemma2")
    with pytest.raises(ValueError, match=r"cannot serve .*gemma\.gguf: .*supported: llama, qwen2"):
        engine_config(foreign)
    hf_dir = tiny_model_dirs("llama")
    bare = write_gguf(hf_dir, tmp_path / "bare", family="llama", with_tokenizer=False)
    with pytest.raises(ValueError, match="carries no tokenizer; give one with --tokenizer DIR"):
        engine_config(bare / "model.gguf")
    types = {name: np.float64 for name in DOWN}
    out = write_gguf(hf_dir, tmp_path / "f64", family="llama", types=types, with_tokenizer=False)
    with pytest.raises(ValueError, match="down_proj is F64; supported types: "):
        engine_config(out / "model.gguf", tokenizer=str(hf_dir))
