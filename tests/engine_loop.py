"""vLLM's engine loop in-process, without a device or worker processes: AotScheduler over a
hand-sized KV pool, hand-built requests, and optionally our runner over a tiny eager model.

`engine_step` is `EngineCore.step` (vllm/v1/engine/core.py) as it runs with our in-process
executor: schedule, `execute_model`, `sample_tokens` unless the runner answered at once,
`update_from_output`. `AsyncEngineLoop` is `EngineCore.step_with_batch_queue` as it runs under
`--async-scheduling`, with the worker's `AsyncSteps` running the runner on its own thread.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.policy_trace import BLOCK_SIZE, CHUNK, MAX_MODEL_LEN, MAX_NUM_SEQS
from vllm_aot.plugin.async_steps import AsyncSteps, QueuedOutput
from vllm_aot.plugin.runner import AotModelRunner
from vllm_aot.plugin.scheduler import AotAsyncScheduler, AotScheduler

NUM_BLOCKS = 65  # the pool `loop_model` (tests/conftest.py) and the schedulers here share


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


def make_scheduler(
    vllm_config: VllmConfig, num_blocks: int, *, is_async: bool = False
) -> AotScheduler:
    """AotScheduler (AotAsyncScheduler) over a pool of `num_blocks` KV blocks (block 0 is vLLM's
    null block)."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # read once, by the constructor
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    vllm_config.scheduler_config.async_scheduling = is_async
    return (AotAsyncScheduler if is_async else AotScheduler)(
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


class AsyncEngineLoop:
    """`EngineCore.step_with_batch_queue` with two batches in flight: a step is scheduled and
    queued before the previous one's output is processed (no structured outputs here)."""

    def __init__(self, scheduler: AotAsyncScheduler, runner: AotModelRunner) -> None:
        self.scheduler = scheduler
        self.steps = AsyncSteps(runner.execute_model, runner.sample_tokens)
        self.in_flight: deque = deque()

    def step(self) -> list[EngineCoreOutput]:
        """One call of the engine's step: the outputs it sends the front end (often none)."""
        scheduler = self.scheduler
        if scheduler.has_requests():
            output = scheduler.schedule()
            assert not output.pending_structured_output_tokens
            result = self.steps.execute_model(output)
            is_executed = output.total_num_scheduled_tokens > 0
            if is_executed:
                result = self.steps.sample_tokens(scheduler.get_grammar_bitmask(output))
            self.in_flight.appendleft((result, output))
            if len(self.in_flight) < 2 and (is_executed or scheduler.has_requests()):
                return []
        if not self.in_flight:
            return []
        result, output = self.in_flight.pop()
        if isinstance(result, QueuedOutput):
            result = result.get_output()
        engine_outputs = scheduler.update_from_output(output, result)
        return [out for outputs in engine_outputs.values() for out in outputs.outputs]

    @property
    def is_idle(self) -> bool:
        return not self.scheduler.has_requests() and not self.in_flight

    def shutdown(self) -> None:
        self.steps.shutdown()


@dataclass
class Engine:
    """vLLM's engine loop over our scheduler and runner, collecting what the front end gets."""

    scheduler: AotScheduler
    runner: AotModelRunner
    block_hasher: object
    max_tokens: int  # a request's unless it says
    async_loop: AsyncEngineLoop | None = None  # None: the synchronous loop
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, FinishReason] = field(default_factory=dict)

    def add(self, req_id: str, prompt: int | list[int], **params) -> Request:
        params = SamplingParams(**({"max_tokens": self.max_tokens, "temperature": 0} | params))
        request = make_request(req_id, prompt, self.block_hasher, params)
        self.scheduler.add_request(request)
        return request

    def step(self, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            if self.async_loop is None:
                outputs = engine_step(self.scheduler, self.runner)
            else:
                outputs = self.async_loop.step()
            for out in outputs:
                self.tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out.finish_reason

    @property
    def is_idle(self) -> bool:
        if self.async_loop is not None:
            return self.async_loop.is_idle
        return not self.scheduler.get_num_unfinished_requests()

    def run(self, max_steps: int = 100) -> None:
        """Steps until every request has finished (and no step is in flight)."""
        for _ in range(max_steps):
            if self.is_idle:
                return
            self.step()
        raise AssertionError("requests never finished")

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
