"""GGUF files read natively: planes equal to what transformers dequantises from the same file,
greedy output equal to the dense model of the same weights, plane-wise shards, the refusals; and
the bundled SmolLM2 GGUF against its prepared fp32 directory."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

from tests.gguf_files import GgmlType, transformers_weights, write_dense_twin, write_gguf
from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.models.formats import weight_format
from vllm_aot.models.gguf import BLOCK_TYPES, GgufFile, GgufWeight, find_gguf, hf_name
from vllm_aot.models.linear import Linear, Rank, Shard, shard_stored, shard_weight
from vllm_aot.models.source import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.generate import GenerationRequest, Generator

CASES = [
    ("llama", GgmlType.Q4_0),
    ("llama", GgmlType.Q4_1),
    ("llama", GgmlType.Q8_0),
    ("llama", GgmlType.Q5_0),
    ("llama", GgmlType.Q5_1),
    ("llama", GgmlType.F32),
    ("qwen2", GgmlType.Q8_0),  # q/k/v biases, an untied head
    ("qwen3", GgmlType.Q4_1),  # q/k norms
]
BUNDLED_FORMATS = (("*", "q4_1"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))
# What a layer of a mixed file (llama.cpp's Q4_K_M) keeps in more bits: its q, k and v
# together (qkv_proj is one fused weight), and down_proj.
MORE_BITS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
# Q4_K_M's own mix: v alone of qkv_proj's parts, and down_proj, in more bits.
V_AND_DOWN = ("self_attn.v_proj", "mlp.down_proj")
PROMPTS = ([1, 450, 4996, 17354, 1701], [1, 3681, 338])


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory, tiny_model_dirs):
    """(family, linear type, {HF name: type}) -> a directory of config.json, tokenizer and
    model.gguf written from the tiny model of that family."""
    made = {}

    def get(family: str, linear_type: GgmlType, types: dict | None = None):
        key = (family, linear_type, tuple(sorted((types or {}).items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"gguf-{family}-{linear_type.name}")
            hf_dir = tiny_model_dirs(family)
            made[key] = write_gguf(hf_dir, out, family=family, linear_type=linear_type, types=types)
        return made[key]

    return get


def dequantized(weight: GgufWeight) -> torch.Tensor:
    if weight.format is None:
        return weight.tensors[0].float()
    return weight_format(weight.format).dequantize(*weight.tensors)


def greedy(source, config, prompts=PROMPTS, max_tokens=8):
    """(the weight formats start-up resolved, the greedy tokens of each prompt)."""
    model, _ = load_model(source, config)
    requests = [GenerationRequest(list(p), max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    return model.config.weight_formats, [r.token_ids for r in Generator(model).generate(requests)]


def type_names(value):
    return value.name if isinstance(value, GgmlType) else None


@pytest.mark.parametrize(("family", "linear_type"), CASES, ids=type_names)
def test_planes_dequantise_to_what_transformers_reads_from_the_file(
    gguf_dirs, tiny_model_dirs, family, linear_type
):
    model_dir = gguf_dirs(family, linear_type)
    expected = transformers_weights(model_dir, tiny_model_dirs(family), family)
    file = GgufFile(model_dir / "model.gguf")
    assert set(file.tensors) == set(expected)
    for name, want in expected.items():
        weight = file.weight(name)
        assert weight.format == (BLOCK_TYPES[weight.type][0] if weight.format else None)
        assert torch.equal(dequantized(weight), want), name
    if linear_type == GgmlType.F32:  # no rounding: the q/k rows are exactly HF's again
        original = load_file(str(tiny_model_dirs(family) / "model.safetensors"))
        q = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(file.weight(q).tensors[0], original[q])


def test_the_header_reads_as_ggufreader_reads_it(gguf_dirs, default_model_dir):
    for path in (gguf_dirs("qwen3", GgmlType.Q4_1) / "model.gguf", find_gguf(default_model_dir)):
        file = GgufFile(path)
        reader = gguf.GGUFReader(path)
        assert file.architecture == reader.fields["general.architecture"].contents()
        for tensor in reader.tensors:
            ours = file.tensors[hf_name(tensor.name)]
            assert ours.type == tensor.tensor_type
            assert ours.shape == tuple(int(d) for d in reversed(tensor.shape))
            assert ours.offset == tensor.data_offset


@pytest.mark.parametrize(
    ("family", "linear_type", "formats"),
    [
        ("llama", GgmlType.Q4_1, BUNDLED_FORMATS),
        ("llama", GgmlType.Q4_0, (("*", "q4_0"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))),
        ("llama", GgmlType.Q5_0, (("*", "q5_0"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))),
        ("llama", GgmlType.Q5_1, (("*", "q5_1"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))),
        ("llama", GgmlType.F32, (("*", "fp32"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))),
        ("qwen2", GgmlType.Q8_0, (("*", "q8_0"),)),
        ("qwen3", GgmlType.Q4_1, BUNDLED_FORMATS),
    ],
    ids=type_names,
)
def test_gguf_greedy_output_equals_the_dense_model_of_the_same_weights(
    gguf_dirs, tiny_model_dirs, tmp_path, family, linear_type, formats
):
    model_dir = gguf_dirs(family, linear_type)
    weights = transformers_weights(model_dir, tiny_model_dirs(family), family)
    dense_dir = write_dense_twin(model_dir, weights, tmp_path / "dense")
    resolved, gguf_tokens = greedy(model_dir, tiny_config(quantization="gguf"))
    assert resolved == formats
    assert greedy(dense_dir, tiny_config()) == ((), gguf_tokens)


def test_layers_stored_in_other_types_serve_as_layer_groups(gguf_dirs, tiny_model_dirs, tmp_path):
    """Layer 1 keeps its attention projections and down_proj in Q8_0, layer 0 in Q4_0 (as
    Q4_K_M keeps some layers' in Q6_K): two layer groups, each with its own layer programs, and
    greedy output equal to the dense model of the dequantised weights."""
    types = {f"model.layers.1.{n}.weight": GgmlType.Q8_0 for n in MORE_BITS}
    model_dir = gguf_dirs("llama", GgmlType.Q4_0, types)
    formats = (("*", "q4_0"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))
    groups = (((1,), (("down_proj", "q8_0"), ("qkv_proj", "q8_0"))),)
    assert resolve_weight_formats(model_dir, "gguf", torch.float32) == (formats, groups)
    model, _ = load_model(model_dir, tiny_config(quantization="gguf"))
    assert model.config.layer_groups == groups
    layer_keys = [k for k in model.programs if k.is_layer]
    assert {k.group for k in layer_keys} == {0, 1}
    assert sum(k.group == 1 for k in layer_keys) == len(layer_keys) // 2
    weights = model.weights.layers
    assert weights[0]["qkv_proj.qweight"].dtype != weights[1]["qkv_proj.qweight"].dtype
    dense_weights = transformers_weights(model_dir, tiny_model_dirs("llama"), "llama")
    dense_dir = write_dense_twin(model_dir, dense_weights, tmp_path / "dense")
    resolved, gguf_tokens = greedy(model_dir, tiny_config(quantization="gguf"))
    assert resolved == formats
    assert greedy(dense_dir, tiny_config()) == ((), gguf_tokens)
    Generator(model).generate([GenerationRequest(list(PROMPTS[0]), max_tokens=2)])
    ran = {k.group for k, n in model.num_executions.items() if n and k.is_layer}
    assert ran == {0, 1}


@pytest.mark.slow  # eight programs compiled: minutes on two cores
def test_layer_groups_compile_export_and_load(gguf_dirs, tmp_path, caplog):
    """Each group's layer programs compiled by Inductor (in workers), exported under their
    names, and loaded back: the same greedy tokens as the eager programs. Group 1 is Q4_K_M's
    mix, its qkv_proj split into q|k and v."""
    from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
    from vllm_aot.loading.export_dir import export_model

    types = {f"model.layers.1.{n}.weight": GgmlType.Q8_0 for n in V_AND_DOWN}
    model_dir = gguf_dirs("llama", GgmlType.Q4_0, types)
    buckets = dict(decode_batch_buckets=(4,), prefill_token_buckets=(64,))
    config = tiny_config(quantization="gguf", backend="inductor", **buckets)
    cache = ProgramCache(CacheSettings(root=tmp_path / "cache"))
    report = export_model(model_dir, tmp_path / "out", config, cache=cache, num_workers=2)
    assert len(report.compile_seconds) == 8  # 3 layer programs per group, 2 heads
    assert "decode_b4_c256_g1" in report.compile_seconds
    with caplog.at_level("INFO"):
        compiled = greedy(tmp_path / "out", None)
    assert compiled == greedy(model_dir, tiny_config(quantization="gguf", **buckets))
    assert (
        "2 layer groups: layers 0 q4_0 (embed_tokens, lm_head: q8_0); "
        "layers 1 down_proj, qkv_proj.2 q8_0"
    ) in caplog.text


def test_compile_only_reads_the_formats_from_the_gguf(gguf_dirs, monkeypatch):
    """`vllm-aot export --compile-only --quantization gguf` fills the cache for the file's own
    formats, read from the file before the programs are asked for."""
    from vllm_aot.cli.main import main
    from vllm_aot.loading import program_sources

    asked = []
    monkeypatch.setattr(
        program_sources, "ensure_programs", lambda arch, config, *a, **k: asked.append(config)
    )
    model_dir = gguf_dirs("llama", GgmlType.Q4_1)
    assert main(["export", str(model_dir), "--compile-only", "--quantization", "gguf"]) == 0
    (config,) = asked
    assert config.weight_formats == BUNDLED_FORMATS


@pytest.mark.parametrize(
    ("types", "message"),
    [
        (
            {f"model.layers.{i}.mlp.down_proj.weight": GgmlType.MXFP4 for i in range(2)},
            "down_proj is MXFP4; supported types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, "
            "F32, F16, BF16",
        ),
    ],
)
def test_files_the_layer_programs_cannot_serve_are_refused(gguf_dirs, types, message):
    model_dir = gguf_dirs("llama", GgmlType.Q4_1, types)
    with pytest.raises(ValueError, match=message):
        resolve_weight_formats(model_dir, "gguf", torch.float32)
    with pytest.raises(ValueError, match=message):  # start-up resolves them the same way
        load_model(model_dir, tiny_config(quantization="gguf"))


def test_the_directory_holds_exactly_one_gguf(gguf_dirs, tmp_path):
    model_dir = shutil.copytree(gguf_dirs("llama", GgmlType.Q4_1), tmp_path / "model")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors.*quantization 'gguf' reads"):
        load_model(model_dir, tiny_config())  # dense weights asked of a GGUF-only directory
    shutil.copy(model_dir / "model.gguf", model_dir / "other.gguf")
    with pytest.raises(ValueError, match=r"found model\.gguf, other\.gguf"):
        find_gguf(model_dir)
    for path in model_dir.glob("*.gguf"):
        path.unlink()
    with pytest.raises(ValueError, match=r"reads the one \*\.gguf in .*; found none"):
        resolve_weight_formats(model_dir, "gguf", torch.float32)


@pytest.mark.parametrize("asked", ["q8_0", "int8", "fp32"])
def test_a_format_the_file_does_not_store_is_refused(gguf_dirs, asked):
    model_dir = gguf_dirs("llama", GgmlType.Q4_1)
    with pytest.raises(
        ValueError, match=f"as Q4_1, but the configuration asks qkv_proj in {asked}"
    ):
        load_weights(
            model_dir,
            load_arch(model_dir),
            torch.float32,
            formats=lambda name: asked,
            quantization="gguf",
        )


def test_a_gguf_of_another_family_than_the_config_is_refused(gguf_dirs, tmp_path):
    model_dir = shutil.copytree(gguf_dirs("llama", GgmlType.Q4_1), tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"holds a llama model but config\.json says Qwen2"):
        resolve_weight_formats(model_dir, "gguf", torch.float32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("shard", list(Shard))
def test_stored_planes_shard_like_the_float_weight(fmt, shard):
    """Each rank's planes equal its float slice quantised: blocks never straddle ranks."""
    linear = Linear(
        name="qkv_proj",
        in_features=128,
        out_parts=(64, 32, 32),
        sources=("q", "k", "v"),
        format=fmt,
        shard=shard,
    )
    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    stored = weight_format(fmt).prepare(weight)
    for index in range(2):
        rank = Rank(index, 2)
        want = weight_format(fmt).prepare(shard_weight(linear, weight, rank))
        got = shard_stored(linear, stored, rank)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# --- the bundled SmolLM2-135M-Instruct.Q4_1.gguf ------------------------------------------------


def test_the_bundled_gguf_planes_are_the_prepared_fp32_weights_bit_for_bit(default_model_dir):
    """The prepared directory's safetensors are transformers' dequantisation of the same file."""
    file = GgufFile(find_gguf(default_model_dir))
    dense = load_file(str(default_model_dir / "model.safetensors"))
    assert set(file.tensors) == set(dense)
    for name, want in dense.items():
        assert torch.equal(dequantized(file.weight(name)), want), name


def test_the_bundled_gguf_serves_q4_1_layers_and_a_tied_q8_0_head(default_model_dir):
    arch = load_arch(default_model_dir)
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_weight_formats(default_model_dir, "gguf", dtype) == (BUNDLED_FORMATS, ())
    formats = dict(BUNDLED_FORMATS)
    weights = load_weights(
        default_model_dir,
        arch,
        torch.float32,
        formats=lambda name: formats.get(name, "q4_1"),
        quantization="gguf",
    )
    assert weights.lm_head is weights.embed and weights.embed.format == "q8_0"
    assert weights.num_bytes() < 100e6  # the file's blocks, not 538 MB of fp32
    config = dict(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=32)
    prompt = [PROMPTS[0]]  # eager, 30 layers: four tokens say enough
    quantized = greedy(default_model_dir, tiny_config(quantization="gguf", **config), prompt, 4)
    assert quantized[0] == BUNDLED_FORMATS
    assert greedy(default_model_dir, tiny_config(**config), prompt, 4) == ((), quantized[1])
