"""vLLM's engine loop in-process, without a device or worker processes: AotScheduler over a
hand-sized KV pool, hand-built requests, and optionally our runner over a tiny eager model.

`engine_step` is `EngineCore.step` (vllm/v1/engine/core.py) as it runs with our in-process
executor: schedule, `execute_model`, `sample_tokens` unless the runner answered at once,
`update_from_output`.
"""

from __future__ import annotations

import random

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.policy_trace import BLOCK_SIZE, CHUNK, MAX_MODEL_LEN, MAX_NUM_SEQS
from vllm_aot.plugin.runner import AotModelRunner
from vllm_aot.plugin.scheduler import AotScheduler


def make_vllm_config(model_dir) -> VllmConfig:
    """The policy trace's shapes (tests/policy_trace.py), through AotPlatform's config hook."""
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=CHUNK,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
    )
    assert config.scheduler_config.max_num_seqs == MAX_NUM_SEQS
    assert config.scheduler_config.max_num_batched_tokens == CHUNK
    assert config.model_config.max_model_len == MAX_MODEL_LEN
    assert config.cache_config.block_size == BLOCK_SIZE
    return config


def make_block_hasher(vllm_config: VllmConfig):
    """What EngineCore gives every request when prefix caching is on."""
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_scheduler(vllm_config: VllmConfig, num_blocks: int) -> AotScheduler:
    """AotScheduler over a pool of `num_blocks` KV blocks (block 0 is vLLM's null block)."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # read once, by the constructor
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return AotScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


def make_request(
    req_id: str, prompt: int | list[int], block_hasher, params: SamplingParams
) -> Request:
    """A request with a random prompt of `prompt` tokens (seeded by its id), or these token ids."""
    if isinstance(prompt, int):
        rng = random.Random(req_id)
        prompt = [rng.randrange(100, 40000) for _ in range(prompt)]
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
    )


def engine_step(scheduler: AotScheduler, runner: AotModelRunner) -> list[EngineCoreOutput]:
    """One EngineCore step; the outputs it sends the front end."""
    output = scheduler.schedule()
    runner_output = runner.execute_model(output)
    if runner_output is None:
        runner_output = runner.sample_tokens(scheduler.get_grammar_bitmask(output))
    engine_outputs = scheduler.update_from_output(output, runner_output)
    return [out for outputs in engine_outputs.values() for out in outputs.outputs]
