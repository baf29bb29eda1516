"""Bucket choice and configuration validation: what a user sees when shapes do not fit."""

from __future__ import annotations

import pytest

from vllm_aot.models.registry import arch_from_hf_config
from vllm_aot.runtime.buckets import pick_bucket, powers_of_two
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import all_program_keys


def test_pick_bucket_takes_the_smallest_that_fits():
    assert pick_bucket((1, 2, 4, 8), 3) == 4
    assert pick_bucket((1, 2, 4, 8), 4) == 4
    assert pick_bucket((1, 2, 4, 8), 1) == 1


def test_pick_bucket_names_the_largest_bucket_when_nothing_fits():
    with pytest.raises(ValueError, match=r"largest bucket \(8\)"):
        pick_bucket((1, 2, 4, 8), 9)


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
