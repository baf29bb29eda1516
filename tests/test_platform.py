"""AotPlatform's start-up refusals and limits, through vLLM's own engine arguments (the path
`vllm serve` flags take), and its front-end request checks; no engine is started."""

from __future__ import annotations

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_aot.plugin.options import RESOLVED_KEY, AotOptions
from vllm_aot.plugin.parallel import machine_id, shm_ident, watch_rank0
from vllm_aot.plugin.platform import AotPlatform
from vllm_aot.plugin.ray_ranks import RAY_RESOURCE, SETUP_HOOK, with_setup_hook

pytestmark = pytest.mark.unit


def engine_config(model_dir, **flags):
    """The VllmConfig `vllm serve --model model_dir` builds with these flags (tiny shapes)."""
    shapes = dict(max_model_len=256, max_num_batched_tokens=64, block_size=16, dtype="float32")
    args = EngineArgs(
        model=str(model_dir), **({"additional_config": {"backend": "eager"}} | shapes | flags)
    )
    return args.create_engine_config()


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (
            {"kv_cache_dtype": "int8_per_token_head"},
            "--kv-cache-dtype int8_per_token_head (supported: auto, which is the model's dtype "
            "float32; fp8, fp8_e4m3, fp8_e5m2)",
        ),
        ({"kv_cache_dtype": "fp8_inc"}, "--kv-cache-dtype fp8_inc (supported: auto"),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
            "--kv-transfer-config (no KV connectors)",
        ),
        (
            {"weight_transfer_config": {"backend": "nccl"}},
            "--weight-transfer-config (the weights are loaded once, at start)",
        ),
        # vLLM itself wants tensor parallelism divisible by it and above the KV heads (2)
        (
            {"decode_context_parallel_size": 2, "tensor_parallel_size": 4},
            "context parallelism (supported: 1)",
        ),
        ({"logprobs_mode": "processed_logprobs"}, "(supported: raw_logprobs)"),
        (
            {"logits_processors": ["vllm.v1.sample.logits_processor.MinPLogitsProcessor"]},
            "--logits-processors (supported: vLLM's sampling parameters",
        ),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_what_we_cannot_run_is_refused_at_start_up(tiny_model_dir, flags, refusal):
    with pytest.raises(ValueError, match="vllm-aot does not support") as excinfo:
        engine_config(tiny_model_dir, **flags)
    assert refusal in str(excinfo.value)


def test_expert_parallelism_reaches_the_runtime_config(tiny_model_dirs):
    """--enable-expert-parallel on an MoE model: its ranks hold whole experts (vLLM itself
    refuses the flag for a dense model, before our hook)."""
    config = engine_config(
        tiny_model_dirs("qwen3_moe"), tensor_parallel_size=2, enable_expert_parallel=True
    )
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert (runtime.tensor_parallel_size, runtime.enable_expert_parallel) == (2, True)
    config = engine_config(tiny_model_dirs("qwen3_moe"), tensor_parallel_size=2)
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert not runtime.enable_expert_parallel  # experts split by intermediate features


def test_tensor_parallelism_runs_on_vllms_executor(tiny_model_dir):
    """Several ranks: vLLM's multiprocessing executor (ours would be "uni"), our workers placing
    themselves, the compiled shapes for the rank count; pipeline parallelism is refused."""
    config = engine_config(tiny_model_dir, tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert config.parallel_config.worker_cls == "vllm_aot.plugin.worker.AotWorker"
    options = AotOptions.from_dict(config.additional_config[RESOLVED_KEY])
    assert options.runtime.tensor_parallel_size == 2
    assert engine_config(tiny_model_dir).parallel_config.distributed_executor_backend == "uni"
    with pytest.raises(ValueError, match=r"pipeline parallelism \(supported: --tensor-parallel"):
        engine_config(tiny_model_dir, pipeline_parallel_size=2)


def test_the_model_dtype_as_kv_cache_dtype_is_accepted(tiny_model_dir):
    config = engine_config(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert config.cache_config.cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16"):
        engine_config(tiny_model_dir, dtype="float32", kv_cache_dtype="bfloat16")


@pytest.mark.parametrize(
    ("flag", "kv_cache_dtype"),
    [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_fp8_kv_cache_dtypes_reach_the_runtime_config(tiny_model_dir, flag, kv_cache_dtype):
    config = engine_config(tiny_model_dir, kv_cache_dtype=flag)
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert runtime.kv_cache_dtype == kv_cache_dtype
    assert runtime.kv_torch_dtype.itemsize == 1


def test_a_kv_cache_dtype_in_additional_config_must_agree_with_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2 contradicts"):
        engine_config(
            tiny_model_dir,
            kv_cache_dtype="fp8_e5m2",
            additional_config={"backend": "eager", "kv_cache_dtype": "fp8"},
        )


@pytest.mark.parametrize(("max_num_seqs", "max_num_batched_tokens"), [(128, 2048), (256, 4096)])
def test_a_given_batch_limit_is_compiled_even_where_it_equals_vllms_default(
    tiny_model_dir, max_num_seqs, max_num_batched_tokens
):
    """vLLM's CPU defaults are 128 or 256 sequences and 2048 or 4096 tokens: given explicitly,
    they are the compiled shapes; not given, ours (32 sequences, 512 tokens or max_model_len)."""
    config = engine_config(
        tiny_model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    runtime = AotOptions.of(config).runtime
    assert (runtime.max_num_seqs, runtime.max_num_batched_tokens) == (
        max_num_seqs,
        max_num_batched_tokens,
    )
    assert runtime.decode_batch_buckets[-1] == max_num_seqs
    assert config.scheduler_config.max_num_seqs == max_num_seqs
    runtime = AotOptions.of(engine_config(tiny_model_dir, max_num_batched_tokens=None)).runtime
    assert (runtime.max_num_seqs, runtime.max_num_batched_tokens) == (32, 256)
    assert runtime.decode_batch_buckets[-1] == 32


@pytest.mark.parametrize("max_logprobs", [-1, 50, 20])
def test_max_logprobs_is_what_the_head_computes(tiny_model_dir, max_logprobs):
    """-1 is vLLM's "no limit": all 20 the head programs compute. A request asking more gets
    vLLM's validation error (HTTP 400) naming the limit."""
    model_config = engine_config(tiny_model_dir, max_logprobs=max_logprobs).model_config
    assert model_config.max_logprobs == 20
    SamplingParams(logprobs=20).verify(model_config, None, None, None)
    for too_many in (21, 50, -1):
        with pytest.raises(VLLMValidationError, match="greater than max allowed: 20"):
            SamplingParams(logprobs=too_many).verify(model_config, None, None, None)


def test_a_lower_max_logprobs_stays(tiny_model_dir):
    assert engine_config(tiny_model_dir, max_logprobs=5).model_config.max_logprobs == 5


@pytest.mark.parametrize(
    "params",
    [{"prompt_logprob_token_ids": [[1, 2]]}, {"logprob_token_ids": [1, 2]}],
    ids=lambda params: next(iter(params)),
)
def test_logprobs_the_head_does_not_compute_are_refused_in_the_front_end(params):
    """A VLLMValidationError, which vLLM answers with HTTP 400 (any other exception: 500)."""
    (name,) = params
    with pytest.raises(VLLMValidationError, match=f"vllm-aot does not return {name}"):
        AotPlatform.validate_request({"type": "token"}, SamplingParams(**params))


def test_prompt_logprobs_and_prompt_embeds_pass_the_front_end(tiny_model_dir):
    config = engine_config(tiny_model_dir, enable_prompt_embeds=True)
    assert config.model_config.enable_prompt_embeds
    AotPlatform.validate_request({"type": "token"}, SamplingParams(prompt_logprobs=5))
    embeds = {"type": "embeds", "prompt_embeds": torch.zeros(3, 64)}
    AotPlatform.validate_request(embeds, SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "inputs",
    [{}, {"prompt_token_ids": [5, 0, 0], "is_token_ids": [True, False, False]}],
    ids=["embeds_alone", "mixed_with_token_ids"],
)
def test_prompt_logprobs_of_positions_given_as_embeddings_are_refused(inputs):
    embeds = {"type": "embeds", "prompt_embeds": torch.zeros(3, 64), **inputs}
    AotPlatform.validate_request(embeds, SamplingParams(max_tokens=4))
    with pytest.raises(VLLMValidationError, match="prompt_logprobs need every prompt token's id"):
        AotPlatform.validate_request(embeds, SamplingParams(prompt_logprobs=1))


def test_int8_quantization_is_a_vllm_flag_that_reaches_the_runtime(tiny_model_dir):
    """`--quantization int8` passes vLLM's validation (our registered name) and becomes every
    linear's weight format in the compiled configuration."""
    from vllm_aot.plugin.options import RESOLVED_KEY, AotOptions

    config = engine_config(tiny_model_dir, quantization="int8")
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert runtime.quantization == "int8" and runtime.formats_summary() == "int8"


def test_a_quantization_we_do_not_run_is_refused_naming_ours(tiny_model_dir):
    with pytest.raises(ValueError, match=r"fp8_per_tensor \(supported: int8, gguf\)"):
        engine_config(tiny_model_dir, quantization="fp8_per_tensor")


def test_gguf_quantization_reads_each_linears_format_from_the_file(default_model_dir):
    from vllm_aot.plugin.options import RESOLVED_KEY, AotOptions

    config = engine_config(default_model_dir, quantization="gguf", dtype="bfloat16")
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert runtime.formats_summary() == "q4_1 (embed_tokens, lm_head: q8_0)"


@pytest.mark.parametrize(("dtype", "factor"), [("bfloat16", 2), ("float32", 4)])
def test_vllm_gives_an_fp8_kv_cache_more_blocks_for_the_same_bytes(tiny_model_dir, dtype, factor):
    """vLLM sizes the pool from the worker's spec: one byte an element instead of two (four)."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from vllm_aot.models.source import load_arch
    from vllm_aot.plugin.worker import AotWorker, kv_cache_spec

    num_blocks = {}
    for flag in ("auto", "fp8"):
        config = engine_config(tiny_model_dir, dtype=dtype, kv_cache_dtype=flag)
        runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
        spec = kv_cache_spec(load_arch(tiny_model_dir), runtime)
        layouts = AotWorker.get_supported_kv_cache_layouts(None)
        resolve_kv_cache_layout(config, [layouts], spec.values())  # as the engine core does
        (kv_config,) = get_kv_cache_configs(config, [spec], [1 << 22])
        num_blocks[flag] = kv_config.num_blocks
    assert num_blocks["fp8"] == factor * num_blocks["auto"]


def test_an_encoder_is_a_pooling_model_with_its_sentence_transformers_pooling(embedding_model_dir):
    """vLLM picks runner pooling for BertModel; we keep vLLM's whole-prompt steps (no chunked
    prefill for bidirectional attention), each up to four of the largest encode bucket, which
    the runner packs into encode programs."""
    config = engine_config(embedding_model_dir, max_num_batched_tokens=512)
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert runtime.runner == "pooling"
    assert runtime.max_num_batched_tokens == max(runtime.prefill_token_buckets) == 512
    assert config.model_config.pooler_config.seq_pooling_type == "MEAN"
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.scheduler_cls.endswith("PoolingScheduler")
    assert config.scheduler_config.max_num_batched_tokens == 4 * 512


def test_dtype_auto_is_one_we_run_for_an_embedding_model_too(embedding_model_dir, tiny_model_dir):
    """vLLM's auto picks a pooling model float16 on a CPU when the platform lists it: ours lists
    bfloat16 first (float32 checkpoints, generating or pooling) and never float16."""
    for model_dir in (embedding_model_dir, tiny_model_dir):
        config = engine_config(model_dir, dtype="auto", max_num_batched_tokens=256)
        assert config.model_config.dtype == torch.bfloat16


def test_a_decoder_converted_to_embeddings_keeps_vllms_chunking(tiny_model_dir):
    """--convert embed: prefill programs alone; LAST-pooled prompts chunked as vLLM chunks them."""
    config = engine_config(tiny_model_dir, runner="pooling", convert="embed")
    runtime = AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).runtime
    assert (runtime.runner, runtime.convert) == ("pooling", "embed")
    assert config.model_config.pooler_config.seq_pooling_type == "LAST"
    assert config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.scheduler_cls.endswith("PoolingScheduler")
    assert config.scheduler_config.max_num_batched_tokens == runtime.max_num_batched_tokens


def test_a_conversion_we_do_not_serve_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="vllm-aot does not support") as excinfo:
        engine_config(tiny_model_dir, runner="pooling", convert="classify")
    assert "--convert classify of a decoder (supported: embed)" in str(excinfo.value)


def test_an_unchunked_pooling_model_needs_a_whole_prompt_a_step(embedding_model_dir):
    """vLLM checks its own flags (none given here: its default holds a prompt); the compiled
    shapes come from --additional-config too."""
    extra = {"backend": "eager", "max_num_batched_tokens": 128}
    with pytest.raises(ValueError, match="supported: max_num_batched_tokens >= max_model_len"):
        engine_config(
            embedding_model_dir,
            max_model_len=256,
            max_num_batched_tokens=None,
            additional_config=extra,
        )


def test_the_engines_threads_are_an_option(tiny_model_dir):
    config = engine_config(tiny_model_dir, additional_config={"backend": "eager", "num_threads": 1})
    assert AotOptions.from_dict(config.additional_config[RESOLVED_KEY]).num_threads == 1
    with pytest.raises(ValueError, match="num_threads must be at least 1, got 0"):
        engine_config(tiny_model_dir, additional_config={"num_threads": 0})


def test_ray_places_one_rank_per_unit_of_our_resource(tiny_model_dir):
    """vLLM's Ray executor asks a bundle of `ray_device_key` per rank: ours, a custom resource
    each node declares; every Ray worker of the engine's job runs our setup hook."""
    pytest.importorskip("ray")
    config = engine_config(
        tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    assert AotPlatform.ray_device_key == RAY_RESOURCE == "vllm_aot_rank"
    assert config.parallel_config.ray_runtime_env["worker_process_setup_hook"] == SETUP_HOOK
    assert config.parallel_config.worker_cls == "vllm_aot.plugin.worker.AotWorker"


def test_vllms_legacy_ray_executor_is_refused(tiny_model_dir, monkeypatch):
    """Its compiled graph calls vLLM's own model runner, which our worker does not have."""
    pytest.importorskip("ray")
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(ValueError, match="VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0, vLLM's legacy"):
        engine_config(tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")


def test_a_ray_runtime_env_keeps_its_settings_but_not_a_setup_hook_of_its_own():
    pytest.importorskip("ray")
    env = with_setup_hook({"env_vars": {"A": "1"}})
    assert env["env_vars"] == {"A": "1"} and env["worker_process_setup_hook"] == SETUP_HOOK
    assert with_setup_hook(env)["worker_process_setup_hook"] == SETUP_HOOK
    with pytest.raises(ValueError, match="its own worker_process_setup_hook"):
        with_setup_hook({"worker_process_setup_hook": "theirs.hook"})


def test_ranks_share_memory_only_on_one_machine():
    """The shared-memory group's name: one per engine and machine, so a group spanning machines
    goes through gloo; the same rendezvous naming as vLLM's CPU worker."""
    here, there = "aaaa", "bbbb"
    assert shm_ident("tcp://10.0.0.1:29500", here) == shm_ident("tcp://10.0.0.1:29500", here)
    assert shm_ident("tcp://10.0.0.1:29500", here) != shm_ident("tcp://10.0.0.1:29500", there)
    assert shm_ident("tcp://10.0.0.1:29500", here) != shm_ident("tcp://10.0.0.1:29501", here)
    assert shm_ident("file:///tmp/rdv/abc", here) == f"abc-{here}"
    assert machine_id() == machine_id() and len(machine_id()) == 12


def test_a_rank_whose_rank_0_is_gone_exits(tmp_path):
    """A follower node's rank watches rank 0's rendezvous and ends its process once it stops
    answering (vLLM's follower would otherwise wait for the next step forever)."""
    import socket
    import subprocess
    import sys

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = (
        "import time; from vllm_aot.plugin.parallel import watch_rank0; "
        f"watch_rank0('tcp://127.0.0.1:{port}', 1, interval=0.2, misses=3); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # rank 0 answers: it keeps running
            child.wait(timeout=2)
        listener.close()
        assert child.wait(timeout=30) == 1
        assert "lost rank 0's rendezvous" in child.stderr.read()
    finally:
        child.kill()
    assert watch_rank0("tcp://127.0.0.1:1", 0) is None, "rank 0 watches no one"
    assert watch_rank0("file:///tmp/x", 1) is None, "one machine: vLLM's executor watches"


def test_ranks_sharing_a_core_are_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match=r"2 tensor-parallel ranks on this machine with 1 cores"):
        engine_config(tiny_model_dir, tensor_parallel_size=2)
    engine_config(tiny_model_dir)  # one rank shares nothing
