"""Bucket choice and configuration validation: what a user sees when shapes do not fit."""

from __future__ import annotations

import pytest

from vllm_aot.models.registry import arch_from_hf_config
from vllm_aot.runtime.buckets import bucket_split, pick_bucket, powers_of_two
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import all_program_keys

pytestmark = pytest.mark.unit


def test_pick_bucket_takes_the_smallest_that_fits():
    assert pick_bucket((1, 2, 4, 8), 3) == 4
    assert pick_bucket((1, 2, 4, 8), 4) == 4
    assert pick_bucket((1, 2, 4, 8), 1) == 1


def test_pick_bucket_names_the_largest_bucket_when_nothing_fits():
    with pytest.raises(ValueError, match=r"largest bucket \(8\)"):
        pick_bucket((1, 2, 4, 8), 9)


def test_bucket_split_pays_for_another_call_only_where_padding_costs_more():
    buckets = (32, 128, 512)
    assert bucket_split(100, buckets, 48) == (100,)  # one 128
    assert bucket_split(130, buckets, 48) == (128, 2)  # 128 + 32 (+ 96) against 512 (+ 48)
    assert bucket_split(260, buckets, 48) == (128, 128, 4)
    assert bucket_split(450, buckets, 48) == (450,)  # four calls would cost more than 512's
    assert bucket_split(512, buckets, 48) == (512,)
    assert bucket_split(130, buckets, 400) == (130,)  # calls dear: one padded call
    assert bucket_split(700, (512,), 48) == (512, 188)  # beyond the largest: whole ones first


def test_powers_of_two_end_at_the_maximum():
    assert powers_of_two(1, 32) == (1, 2, 4, 8, 16, 32)
    assert powers_of_two(16, 48) == (16, 32, 48)


def test_default_buckets_cover_the_limits():
    config = RuntimeConfig()
    assert config.decode_batch_buckets == (1, 2, 4, 8, 16, 32)
    assert config.decode_context_buckets == (256, 1024, 2048)
    assert config.prefill_token_buckets == (32, 128, 512)
    assert config.prefill_context_buckets == (0, 256, 512, 1024, 2048)  # 0: a fresh prompt's
    names = [key.name for key in all_program_keys(config)]
    assert "decode_b8_c1024" in names and "prefill_t512_c2048" in names
    assert "prefill_t128_c0" in names
    assert "greedy_r32" in names and "sample_r1" in names
    assert len(names) == len(set(names)) == 15 + 18 + 12


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_model_len": 100, "block_size": 16}, "multiple of block_size"),
        ({"decode_batch_buckets": (1, 2)}, "largest of decode_batch_buckets must be 32"),
        ({"decode_context_buckets": (100, 2048)}, "multiples of block_size"),
        ({"dtype": "float16"}, "supported: \\['float32', 'bfloat16'\\]"),
        ({"backend": "neuron"}, "supported: \\['inductor', 'eager'\\]"),
        ({"num_kv_blocks": 10}, "cannot hold one sequence of max_model_len"),
    ],
)
def test_invalid_configurations_are_refused_with_the_limit(fields, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**fields)


def test_config_round_trips_through_a_dict():
    config = RuntimeConfig(max_num_seqs=8, decode_context_buckets=(512, 2048))
    assert RuntimeConfig.from_dict(config.to_dict()) == config


def test_unsupported_architecture_lists_the_supported_ones():
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(ValueError, match="supported: BertModel, LlamaForCausalLM, Mistral"):
        arch_from_hf_config(config)


def test_an_encode_step_takes_the_smallest_bucket_then_the_narrowest_window():
    """Sentences of a few dozen tokens attend in windows of 64, not max_model_len's 256, and
    pack longest first: 40 + 20 share a window that 40 + 40 + 20 in order would not leave."""
    from vllm_aot.runtime.encode_inputs import EncoderSequence, encode_layout, prepare_encode

    config = RuntimeConfig(runner="pooling", max_model_len=256, max_num_seqs=32)
    assert [k.name for k in all_program_keys(config)] == [
        "encode_t32_w32",
        "encode_t64_w64",
        "encode_t128_w64",
        "encode_t128_w128",
        "encode_t256_w64",
        "encode_t256_w128",
        "encode_t256_w256",
        "encode_t512_w64",
        "encode_t512_w128",
        "encode_t512_w256",
    ]
    key, starts = encode_layout([40, 40, 20], config)
    assert (key.size, key.window) == (128, 64)
    assert sorted(starts) == [0, 40, 64]  # 40 | 40 + 20: two windows of 64
    key, _ = encode_layout([100, 20], config)
    assert (key.size, key.window) == (128, 128)
    key, _ = encode_layout([200, 100], config)
    assert (key.size, key.window) == (512, 256)
    assert encode_layout([256, 256, 1], config) is None

    sequences = [EncoderSequence([7] * n) for n in (40, 40, 20)]
    inputs = prepare_encode(sequences, config)
    assert inputs.attn_mask.shape == (2, 64, 64)
    for seq, start in zip(sequences, inputs.starts, strict=True):
        window, offset = divmod(start, 64)
        n = len(seq.token_ids)
        assert offset + n <= 64  # within one window
        assert inputs.attn_mask[window, offset, offset : offset + n].all()
        assert inputs.attn_mask[window, offset].sum() == n  # sees its own sequence alone
        assert inputs.positions[start : start + n].tolist() == list(range(n))


def test_encode_steps_pack_longest_first_and_keep_sentences_out_of_a_passages_window():
    """A passage of 200 tokens and sentences of 10-60: the passage's step attends over 256,
    the sentences' steps over 64, and a short sentence fills the gap a longer one left."""
    from vllm_aot.runtime.encode_inputs import encode_layout, encode_steps

    config = RuntimeConfig(runner="pooling", max_model_len=256, max_num_seqs=32)
    lengths = [10, 200, *([60] * 9), 50, 30]
    steps = encode_steps(lengths, config)
    assert sorted(i for step in steps for i in step) == list(range(len(lengths)))
    keys = [encode_layout([lengths[i] for i in step], config)[0] for step in steps]
    assert (keys[0].name, steps[0]) == ("encode_t256_w256", [1])  # the passage alone
    assert [k.name for k in keys[1:]] == ["encode_t512_w64", "encode_t256_w64"]
    last = [lengths[i] for i in steps[2]]
    assert last == [60, 50, 30, 10]
    _, starts = encode_layout(last, config)
    assert starts[3] // 64 == starts[1] // 64  # the 10 fills the 50's window
