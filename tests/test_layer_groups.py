"""Layer groups (`runtime/layer_groups.py`): the configuration's form, the programs of each group,
their names and cache keys (a one-group model's hold nothing of groups), the progress line; a
fused linear whose parts a group stores in different formats, split into runs of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import tiny_arch, tiny_config
from vllm_aot.cache.keys import program_cache_key, program_fingerprint
from vllm_aot.loading.program_sources import check_fits
from vllm_aot.loading.progress import CompileProgress, seconds_by_group
from vllm_aot.models.linear import Linear, Rank, Shard, shard_bias, shard_weight, split_by_format
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, ProgramKind, all_program_keys, layer_spec

pytestmark = pytest.mark.unit

FORMATS = (("*", "q4_0"), ("embed_tokens", "q8_0"), ("lm_head", "q8_0"))
OVERRIDES = (("down_proj", "q8_0"), ("qkv_proj", "q8_0"))
V_ONLY = (("down_proj", "q8_0"), ("qkv_proj.2", "q8_0"))  # Q4_K_M's mix: v alone of q|k|v


def two_groups(**overrides) -> RuntimeConfig:
    """Layer 1 of the tiny Llama in group 1: its qkv_proj and down_proj in q8_0."""
    fields = dict(quantization="gguf", weight_formats=FORMATS, layer_groups=(((1,), OVERRIDES),))
    return tiny_config(**{**fields, **overrides})


def test_one_group_keeps_its_program_names():
    config = tiny_config(quantization="gguf", weight_formats=FORMATS)
    assert config.num_layer_groups == 1 and config.for_group(0) is config
    names = [k.name for k in all_program_keys(config)]
    assert "decode_b4_c256" in names and not any("_g" in n for n in names)
    assert ProgramKey(ProgramKind.DECODE, 8, 1024, group=1).name == "decode_b8_c1024_g1"


def test_each_group_has_the_layer_programs_and_the_heads_are_shared():
    one = all_program_keys(two_groups(layer_groups=(), num_speculative_tokens=2))
    two = all_program_keys(two_groups(num_speculative_tokens=2))
    assert [k for k in two if not k.is_layer] == [k for k in one if not k.is_layer]
    layers = [k for k in one if k.is_layer]
    assert {k.kind for k in layers} == {ProgramKind.PREFILL, ProgramKind.DECODE, ProgramKind.VERIFY}
    assert sorted(k for k in two if k.is_layer) == sorted(
        [*layers, *(dataclasses.replace(k, group=1) for k in layers)]
    )


def test_a_groups_programs_are_keyed_as_a_one_group_model_in_its_formats():
    """Group 0's layer programs and the heads have the keys of the model without the group,
    group 1's those of a model with its formats everywhere: a one-group model's keys are
    what they are without groups, and caches share programs across models."""
    arch, config = tiny_arch(), two_groups()
    plain = tiny_config(quantization="gguf", weight_formats=FORMATS)
    group1 = tiny_config(quantization="gguf", weight_formats=FORMATS + OVERRIDES)
    for key in all_program_keys(config):
        like = group1 if key.group else plain
        want = program_cache_key(arch, like, dataclasses.replace(key, group=0))
        assert program_cache_key(arch, config, key) == want, key.name
    fingerprint = program_fingerprint(arch, plain, all_program_keys(plain)[0])
    assert "layer_groups" not in fingerprint["runtime"] and "group" not in fingerprint["program"]


def test_the_configuration_normalises_and_checks_groups():
    config = two_groups(layer_groups=[[[1], [["qkv_proj", "q8_0"], ["o_proj", "q4_0"]]]])
    assert config.layer_groups == (((1,), (("qkv_proj", "q8_0"),)),)  # o_proj's is group 0's
    assert RuntimeConfig.from_dict(config.to_dict()) == config
    assert [config.layer_group(i) for i in range(3)] == [0, 1, 0]
    assert config.for_group(1).linear_format("qkv_proj") == "q8_0"
    assert config.layer_formats(0)("qkv_proj") == "q4_0"
    assert config.formats_used() == {"q4_0", "q8_0"}
    assert config.for_draft().layer_groups == ()
    bad = [
        (((0, 1), OVERRIDES), ((1,), (("o_proj", "q8_0"),))),  # layer 1 twice
        (((1,), (("o_proj", "q4_0"),)),),  # nothing differs from group 0
        (((1,), OVERRIDES), ((2,), OVERRIDES)),  # the same formats twice
    ]
    for groups in bad:
        with pytest.raises(ValueError, match="layer group"):
            two_groups(layer_groups=groups)
    with pytest.raises(ValueError, match="layer_groups are for a decoder's quantised weights"):
        tiny_config(layer_groups=(((1,), OVERRIDES),))
    with pytest.raises(ValueError, match=r"layer_groups name layers \[2\]; the model has 2"):
        check_fits(tiny_arch(), two_groups(layer_groups=(((1, 2), OVERRIDES),)))


def test_the_summaries_name_each_group():
    config = two_groups(layer_groups=(((1, 2, 3, 5), OVERRIDES),))
    assert config.groups_summary(6) == (
        "2 layer groups: layers 0,4 q4_0 (embed_tokens, lm_head: q8_0); "
        "layers 1-3,5 down_proj, qkv_proj q8_0"
    )
    assert config.formats_summary() == (
        "q4_0 (embed_tokens, lm_head: q8_0); layers 1-3,5: down_proj, qkv_proj q8_0"
    )


def test_compile_progress_counts_each_group():
    lines = []
    progress = CompileProgress(3, write=lines.append, groups={0: 1, 1: 1}, clock=lambda: 0.0)
    for group in (0, 1, None):
        progress.update(group)
    assert lines == [
        "compiling programs: 3/3 done, 0s elapsed (layer programs by group 0: 1/1, 1: 1/1)"
    ]


def test_compile_seconds_are_summed_per_group():
    keys = all_program_keys(two_groups())
    seconds = {k.name: 2.0 for k in keys}
    layers = [k for k in keys if k.is_layer]
    heads = len(keys) - len(layers)
    per_group = len(layers) // 2
    assert seconds_by_group(seconds, keys) == (
        f"head: {heads} programs, {2 * heads} s; "
        f"layer group 0: {per_group} programs, {2 * per_group} s; "
        f"layer group 1: {per_group} programs, {2 * per_group} s"
    )


def test_a_linear_splits_into_runs_of_parts_that_share_a_format():
    """q|k in one format and v in another: two runs, each a linear of its parts; per rank, the
    runs' column shards (weight and bias) concatenated are the whole linear's."""
    qkv = Linear("qkv_proj", 12, (16, 8, 8), ("q", "k", "v"), "fp32", Shard.COLUMN, True)
    runs = split_by_format(qkv, lambda name: "q8_0" if name == "qkv_proj.2" else "q4_0")
    assert [(r.name, r.out_parts, r.sources, r.format, r.part_of) for r in runs] == [
        ("qkv_proj.0", (16, 8), ("q", "k"), "q4_0", "qkv_proj"),
        ("qkv_proj.2", (8,), ("v",), "q8_0", "qkv_proj"),
    ]
    assert split_by_format(qkv, lambda name: "q8_0") == (dataclasses.replace(qkv, format="q8_0"),)
    weight, bias = torch.randn(32, 12), torch.randn(32)
    for index in range(2):
        rank = Rank(index, 2)
        parts = zip(runs, weight.split([24, 8]), bias.split([24, 8]), strict=True)
        shards = [(shard_weight(r, w, rank), shard_bias(r, b, rank)) for r, w, b in parts]
        assert torch.equal(torch.cat([w for w, _ in shards]), shard_weight(qkv, weight, rank))
        assert torch.equal(torch.cat([b for _, b in shards]), shard_bias(qkv, bias, rank))


def test_without_split_parts_the_programs_and_keys_are_the_fused_ones():
    """A configuration naming no part, or every part in one format, has the whole linears, and
    so the programs and keys of the fused model; a group naming v alone splits qkv_proj in its
    own layer programs only, named and keyed as the group of a model in its formats."""
    arch, plain = tiny_arch(), tiny_config(quantization="gguf", weight_formats=FORMATS)
    fused = layer_spec(arch, plain).tensor_names()
    assert fused[:4] == (
        "input_layernorm.weight",
        "qkv_proj.qweight",
        "qkv_proj.scale",
        "o_proj.qweight",
    )
    every_part = two_groups(
        layer_groups=(((1,), tuple((f"qkv_proj.{i}", "q8_0") for i in range(3))),)
    )
    whole = layer_spec(arch, two_groups().for_group(1)).tensor_names()
    assert layer_spec(arch, every_part.for_group(1)).tensor_names() == whole
    config = two_groups(layer_groups=(((1,), V_ONLY),))
    assert config.layer_groups == (((1,), V_ONLY),)
    assert [k.name for k in all_program_keys(config)] == [
        k.name for k in all_program_keys(two_groups())
    ]
    assert layer_spec(arch, config.for_group(0)).tensor_names() == fused
    split = layer_spec(arch, config.for_group(1))
    assert [(r.name, r.format) for r in split.runs("qkv_proj")] == [
        ("qkv_proj.0", "q4_0"),
        ("qkv_proj.2", "q8_0"),
    ]
    assert config.layer_formats(1)("qkv_proj.0") == "q4_0"
    assert config.formats_used() == {"q4_0", "q8_0"}
    group1 = tiny_config(quantization="gguf", weight_formats=FORMATS + V_ONLY)
    for key in all_program_keys(config):
        like = group1 if key.group else plain
        want = program_cache_key(arch, like, dataclasses.replace(key, group=0))
        assert program_cache_key(arch, config, key) == want, key.name
    assert config.groups_summary(2) == (
        "2 layer groups: layers 0 q4_0 (embed_tokens, lm_head: q8_0); "
        "layers 1 down_proj, qkv_proj.2 q8_0"
    )
