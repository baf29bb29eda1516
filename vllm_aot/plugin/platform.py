"""AotPlatform: vLLM's CPU platform, running our compiled runtime instead of vLLM's model runner.

Subclassing CpuPlatform keeps everything vLLM does for a CPU device (thread and memory set-up,
gloo, the CPU defaults). `check_and_update_config` is the documented hook where a platform
installs its worker and scheduler; we also resolve our options there, once, and make vLLM's
scheduler limits agree with the compiled shapes.
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar

import torch
import vllm.envs as envs
from vllm.platforms.cpu import CpuPlatform

from vllm_aot.models.registry import encoder_architectures, supported_architectures
from vllm_aot.placement import available_cores, shared_cores_problem
from vllm_aot.plugin.engine_flags import GIVEN_KEY, record_given
from vllm_aot.plugin.front_end import plan_front_end
from vllm_aot.plugin.gguf_model import install as read_gguf_models
from vllm_aot.plugin.metrics import register_collector
from vllm_aot.plugin.options import (
    FP8_KV_CACHE_DTYPES,
    RESOLVED_KEY,
    convert_type,
    resolve_engine_options,
    step_token_budget,
)
from vllm_aot.plugin.ray_ranks import RAY_RESOURCE, with_setup_hook
from vllm_aot.plugin.spec_decode import (
    speculative_problems,
)
from vllm_aot.runtime.config import CONVERTS, QUANTIZATIONS, RUNNERS

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it

WORKER_CLS = "vllm_aot.plugin.worker.AotWorker"
SCHEDULER_CLS = "vllm_aot.plugin.scheduler.AotScheduler"
ASYNC_SCHEDULER_CLS = "vllm_aot.plugin.scheduler.AotAsyncScheduler"
# Pooling models: vLLM's own steps (whole prompts, several a step), each held while a request's
# prompts still arrive; failures reported.
POOLING_SCHEDULER_CLS = "vllm_aot.plugin.scheduler.PoolingScheduler"


def _refuse_unsupported(vllm_config) -> None:
    """Options our runtime cannot honour fail here, naming what is supported."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    problems = []
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if not set(archs) & set(supported_architectures()):
        problems.append(f"architecture {archs} (supported: {', '.join(supported_architectures())})")
    if parallel.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (supported: --tensor-parallel-size)")
    problems += _refuse_shared_cores(parallel)
    if parallel.data_parallel_size > 1:
        problems.append("vLLM's data parallelism (use vllm-aot serve --data-parallel-size)")
    problems += speculative_problems(
        vllm_config.speculative_config, model_config, parallel.tensor_parallel_size
    )
    if vllm_config.lora_config is not None:
        problems.append("LoRA adapters")
    problems += _refuse_runner(model_config, archs)
    if model_config.quantization not in (None, *QUANTIZATIONS):
        problems.append(
            f"--quantization {model_config.quantization} (supported: {', '.join(QUANTIZATIONS)})"
        )
    if model_config.is_multimodal_model:
        problems.append("multimodal models")
    if model_config.logits_processors:
        problems.append(
            "--logits-processors (supported: vLLM's sampling parameters, penalties, bias, "
            "min_tokens, bad words, allowed tokens)"
        )
    dtype = str(model_config.dtype).removeprefix("torch.")
    if vllm_config.cache_config.cache_dtype not in ("auto", dtype, *FP8_KV_CACHE_DTYPES):
        problems.append(
            f"--kv-cache-dtype {vllm_config.cache_config.cache_dtype} "
            f"(supported: auto, which is the model's dtype {dtype}; "
            f"{', '.join(FP8_KV_CACHE_DTYPES)})"
        )
    if model_config.logprobs_mode != "raw_logprobs":
        problems.append(f"--logprobs-mode {model_config.logprobs_mode} (supported: raw_logprobs)")
    if vllm_config.kv_transfer_config is not None:
        problems.append("--kv-transfer-config (no KV connectors)")
    if vllm_config.weight_transfer_config is not None:
        problems.append("--weight-transfer-config (the weights are loaded once, at start)")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        problems.append("context parallelism (supported: 1)")
    if parallel.use_ray and not envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:
        problems.append(
            "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0, vLLM's legacy Ray executor (supported: its "
            "default Ray executor)"
        )
    if problems:
        raise ValueError("vllm-aot does not support " + "; ".join(problems))


def _refuse_shared_cores(parallel) -> list[str]:
    """Ranks of one machine each need a core of their own (`placement.py`). Ray places its
    ranks on nodes only once the engine runs; each node declares its own ranks."""
    if parallel.world_size == 1 or parallel.use_ray:
        return []
    problem = shared_cores_problem(parallel.local_world_size, available_cores())
    return [problem] if problem else []


def _refuse_runner(model_config, archs: list[str]) -> list[str]:
    """Encoders serve runner "pooling" as they are, decoders "generate" or "pooling" converted
    by --convert embed (vLLM itself refuses "generate" for an embedding model, and sequence
    pooling other than CLS, MEAN and LAST)."""
    runner = model_config.runner_type
    if runner not in RUNNERS:
        return [f"runner {runner!r} (supported: {', '.join(RUNNERS)})"]
    convert = convert_type(model_config)
    is_encoder = bool(set(archs) & set(encoder_architectures()))
    if runner == "pooling" and not is_encoder and convert not in CONVERTS:
        return [f"--convert {convert} of a decoder (supported: {', '.join(CONVERTS)})"]
    return []


def _refuse_unchunked_budget(scheduler_config, runtime) -> None:
    """vLLM does not chunk some pooling prompts (bidirectional attention, MEAN or CLS pooling):
    a step must hold a whole prompt of max_model_len, or such a prompt would wait forever."""
    if runtime.runner != "pooling" or scheduler_config.enable_chunked_prefill:
        return
    if runtime.max_num_batched_tokens < runtime.max_model_len:
        raise ValueError(
            f"vllm-aot does not support --max-num-batched-tokens {runtime.max_num_batched_tokens} "
            f"below --max-model-len {runtime.max_model_len} for a pooling model whose prompts "
            "vLLM does not chunk (supported: max_num_batched_tokens >= max_model_len)"
        )


def _speculative_summary(spec_config, options) -> str:
    """What the start-up line shows of speculative decoding."""
    if spec_config is None:
        return "off"
    runtime = options.runtime
    draft = f", draft {options.draft_model}" if options.draft_model else ""
    return (
        f"{spec_config.method} k={runtime.num_speculative_tokens}{draft} "
        f"(verify batches {runtime.verify_batch_buckets})"
    )


def _max_logprobs(requested: int, num_logprobs: int) -> int:
    """vLLM's --max-logprobs within the top-n the head programs compute; -1 (vLLM's "no limit")
    means all of them. vLLM refuses a request asking more with HTTP 400 naming this limit."""
    if requested < 0 or requested > num_logprobs:
        logger.info(
            "vllm-aot: max_logprobs %d -> %d, the top-n logprobs the head programs compute",
            requested,
            num_logprobs,
        )
        return num_logprobs
    return requested


def _is_async(scheduler_config, runner: str, spec_config) -> bool:
    """Whether steps are scheduled asynchronously: vLLM's choice (before CpuPlatform's veto),
    except for pooling models and speculative decoding."""
    is_async = bool(scheduler_config.async_scheduling)
    if is_async and runner == "pooling":  # vLLM's default for pooling models too
        logger.warning("vllm-aot: pooling models are scheduled synchronously")
        return False
    if is_async and spec_config is not None:  # vLLM keeps it on for draft_model
        logger.warning("vllm-aot: speculative decoding is scheduled synchronously")
        return False
    return is_async


def _set_up_executor(parallel) -> None:
    """One rank: the engine process holds the worker, no extra process hop per step. Several:
    vLLM's executor as given (multiprocessing by default, or Ray: `plugin/ray_ranks.py`); each
    worker takes its share of the cores (`placement.rank_cores`), so vLLM's own binding (which
    reserves a core per rank for its scheduler) is off."""
    if parallel.world_size == 1:
        parallel.distributed_executor_backend = "uni"
        return
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if parallel.use_ray:
        parallel.ray_runtime_env = with_setup_hook(parallel.ray_runtime_env)


def _log_shapes(runtime, artifact_dir, *, is_async: bool) -> None:
    source = f", from {artifact_dir}" if artifact_dir else ""
    if runtime.is_encoder_runner:
        logger.info(
            "vllm-aot: %s backend, %s, weights %s, encoder (no KV cache), max_num_seqs=%d, "
            "max_model_len=%d, encode buckets %s, attention windows %s%s",
            runtime.backend,
            runtime.dtype,
            runtime.formats_summary(),
            runtime.max_num_seqs,
            runtime.max_model_len,
            runtime.prefill_token_buckets,
            runtime.encode_windows(max(runtime.prefill_token_buckets)),
            source,
        )
        return
    logger.info(
        "vllm-aot: %s backend, %s, weights %s, KV cache %s, max_num_seqs=%d, "
        "max_model_len=%d, block_size=%d, prefill chunks %s, decode batches %s, "
        "decode contexts %s, %s scheduling%s",
        runtime.backend,
        runtime.dtype,
        runtime.formats_summary(),
        runtime.kv_torch_dtype,
        runtime.max_num_seqs,
        runtime.max_model_len,
        runtime.block_size,
        runtime.prefill_token_buckets,
        runtime.decode_batch_buckets,
        runtime.decode_context_buckets,
        "async" if is_async else "synchronous",
        source,
    )


class AotPlatform(CpuPlatform):
    device_name = "cpu"
    # vLLM's Ray executor places one rank per unit of this resource (`plugin/ray_ranks.py`).
    ray_device_key: ClassVar[str] = RAY_RESOURCE
    # vLLM checks --quantization against this list (`plugin/quantization.py` registers the names).
    supported_quantization: ClassVar[list[str]] = list(QUANTIZATIONS)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # vLLM's --dtype auto takes the first: a float32 checkpoint runs in bfloat16, an embedding
        # model too (vLLM's CPU backend would pick float16 for it, which our programs do not take).
        return [torch.bfloat16, torch.float32]

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        if quant not in QUANTIZATIONS:
            raise ValueError(
                f"vllm-aot does not support --quantization {quant} "
                f"(supported: {', '.join(QUANTIZATIONS)})"
            )

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        record_given()  # vLLM calls this before it fills in its defaults (plugin/engine_flags.py)
        read_gguf_models()  # a .gguf file as the model (plugin/gguf_model.py)
        super().pre_register_and_update(parser)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if model_config is None:  # bare configs built by vLLM internals and tests
            return super().check_and_update_config(vllm_config)
        _refuse_unsupported(vllm_config)
        cache_config = vllm_config.cache_config
        scheduler_config = vllm_config.scheduler_config
        spec_config = vllm_config.speculative_config
        is_async = _is_async(scheduler_config, model_config.runner_type, spec_config)
        options = resolve_engine_options(vllm_config, is_async=is_async)
        runtime = options.runtime
        register_collector(options.stats_file)
        super().check_and_update_config(vllm_config)
        scheduler_config.async_scheduling = is_async
        plan_front_end(options.front_end_cores, is_async=is_async)  # the API server's, once forked
        if os.environ.get("VLLM_AOT_ENGINE_FORK") == "1":
            # Fork the engine process from the front end instead of spawning a fresh interpreter
            # that imports vLLM again (~12 s here). `vllm-aot serve` asks for it: its front end
            # has run no torch kernels, so no OpenMP pool is copied into the child. A library
            # user's process may have one (GNU OpenMP does not survive fork): spawn stays theirs.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        is_pooling = runtime.runner == "pooling"
        _refuse_unchunked_budget(scheduler_config, runtime)
        if not scheduler_config.enable_chunked_prefill and not is_pooling:
            logger.warning("vllm-aot always prefills long prompts in chunks; enabling it")
            scheduler_config.enable_chunked_prefill = True

        # The compiled shapes are the limits vLLM schedules within.
        model_config.max_model_len = runtime.max_model_len
        scheduler_config.max_model_len = runtime.max_model_len
        scheduler_config.max_num_seqs = runtime.max_num_seqs
        scheduler_config.max_num_batched_tokens = step_token_budget(runtime)
        cache_config.block_size = runtime.block_size
        model_config.max_logprobs = _max_logprobs(model_config.max_logprobs, runtime.num_logprobs)
        vllm_config.parallel_config.worker_cls = WORKER_CLS
        scheduler_config.scheduler_cls = (
            POOLING_SCHEDULER_CLS
            if is_pooling
            else ASYNC_SCHEDULER_CLS
            if is_async
            else SCHEDULER_CLS
        )
        _set_up_executor(vllm_config.parallel_config)
        extra = {k: v for k, v in (vllm_config.additional_config or {}).items() if k != GIVEN_KEY}
        vllm_config.additional_config = {**extra, RESOLVED_KEY: options.to_dict()}
        _log_shapes(runtime, options.artifact_dir, is_async=is_async)
        logger.info(
            "vllm-aot: speculative decoding %s",
            _speculative_summary(spec_config, options),
        )

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Front-end check for what the compiled runtime cannot serve: logprobs of chosen token
        ids (the head programs return the top-n), prompt logprobs of positions given as
        embeddings. A VLLMValidationError is HTTP 400; vLLM answers any other exception here
        with a bare 500."""
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        if not isinstance(params, SamplingParams):
            return super().validate_request(processed_inputs, params)
        for name in ("prompt_logprob_token_ids", "logprob_token_ids"):
            if getattr(params, name) is not None:
                raise VLLMValidationError(
                    f"vllm-aot does not return {name}; it returns the top-n logprobs of "
                    "generated and prompt tokens (logprobs=n, prompt_logprobs=n)",
                    parameter=name,
                )
        if processed_inputs.get("type") == "embeds":
            _refuse_embeds_request(processed_inputs, params, VLLMValidationError)
        super().validate_request(processed_inputs, params)


def _refuse_embeds_request(processed_inputs, params, error: type[Exception]) -> None:
    """`error` (HTTP 400) for a prompt_embeds request the runner cannot serve. vLLM's loader
    has already checked the embeddings' shape against the model and cast them to its dtype."""
    has_every_id = processed_inputs.get("prompt_token_ids") is not None
    if params.prompt_logprobs is not None and not (
        has_every_id and processed_inputs.get("is_token_ids") is None
    ):
        raise error(
            "prompt_logprobs need every prompt token's id; prompt embeddings have none",
            parameter="prompt_logprobs",
        )
