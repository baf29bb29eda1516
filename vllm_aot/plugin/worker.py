"""AotWorker: the vLLM worker that owns our compiled model.

Start-up, in the order vLLM calls it: `init_device` (vLLM's process groups when there are several
ranks, this rank's cores and threads: parallel.py), `load_model` (programs and weights
through the one start-up path, `loading.startup.start`), `get_kv_cache_spec` (our pools' geometry),
`determine_available_memory` (the KV budget), `initialize_from_config` (pool of vLLM's block
count), `compile_or_warm_up_model` (compile/load report). Then `execute_model`/`sample_tokens`
per step, delegated to AotModelRunner (on a thread of its own under `--async-scheduling`, see
async_steps.py); `profile` between steps (vLLM's `/start_profile` and
`/stop_profile`, see profiling.py). The stats file (metrics.py) gets the start-up counters in
`load_model` and the step counters from a background thread from `initialize_from_config` on.
vLLM's engine controls (`/pause`, sleep mode, `--max-model-len -1`'s auto-fit) get the answers
vLLM's CPU worker gives (the methods after `get_model`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import psutil
import torch
from vllm.config.profiler import validate_profile_prefix
from vllm.profiler.wrapper import validate_worker_profiler_config
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_aot.cache.program_cache import ProgramCache
from vllm_aot.loading.program_sources import ProgramOptions
from vllm_aot.loading.startup import start
from vllm_aot.models.config import ModelArch
from vllm_aot.models.experts import rank_share
from vllm_aot.placement import RESERVED_ENV, compute_cores, pin_threads
from vllm_aot.plugin.async_steps import AsyncSteps
from vllm_aot.plugin.front_end import front_end_nice, lower_python_threads, python_threads
from vllm_aot.plugin.metrics import StatsFile, StepClock, load_stats, model_stats
from vllm_aot.plugin.options import AotOptions
from vllm_aot.plugin.parallel import join_ranks
from vllm_aot.plugin.pooling import DecoderPoolingRunner, PoolingRunner
from vllm_aot.plugin.profiling import WorkerProfiler
from vllm_aot.plugin.runner import AotModelRunner
from vllm_aot.plugin.spec_decode import Drafter, make_drafter
from vllm_aot.runtime.config import RuntimeConfig

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers show it


_HOW = {
    "local": "loaded from the local cache",
    "remote": "fetched from the remote store",
    "compiled": "compiled",
}


def _log_program(name: str, source: str, seconds: float) -> None:
    logger.info("vllm-aot: program %s %s in %.3f s", name, _HOW[source], seconds)


def _log_progress(line: str) -> None:
    logger.info("vllm-aot: %s", line)


def kv_cache_spec(arch: ModelArch, runtime: RuntimeConfig) -> dict[str, FullAttentionSpec]:
    """Every layer's pool geometry (`arch`: the rank's share), by which vLLM sizes a block's page
    and so the number of blocks a KV budget holds: an fp8 KV cache dtype halves a bfloat16 page
    (quarters a float32 one), so the same budget holds twice (four times) the blocks. An
    encoder has none (vLLM's attention-free case: no KV cache groups, no blocks)."""
    if arch.is_encoder:
        return {}
    spec = FullAttentionSpec(
        block_size=runtime.block_size,
        num_kv_heads=arch.num_kv_heads,
        head_size=arch.head_dim,
        dtype=runtime.kv_torch_dtype,
    )
    return {f"model.layers.{i}.self_attn": spec for i in range(arch.num_layers)}


class AotWorker(WorkerBase):
    def init_device(self) -> None:
        self.device = torch.device("cpu")
        self.options = AotOptions.of(self.vllm_config)
        self.place = join_ranks(
            self.vllm_config,
            rank=self.rank,
            local_rank=self.local_rank,
            init_method=self.distributed_init_method,
        )
        # The front end's own cores, where the platform reserved some (placement.py).
        front_end = self.options.front_end_cores
        compute = compute_cores(self.place.cores, front_end)
        torch.set_num_threads(self.options.num_threads or len(compute))
        self.runner: AotModelRunner | PoolingRunner | DecoderPoolingRunner | None = None
        self.stats_file: StatsFile | None = None
        self.profiler: WorkerProfiler | None = None
        # Under --async-scheduling every torch call of ours runs on the step thread, loading
        # included: the engine's main thread then starts no OpenMP team, and the step thread's
        # is the process's only one. libgomp cuts its threads' spinning to almost nothing once
        # it manages more threads than there are cores, and a decode step's ~150 parallel
        # loops then each wait for a sleeping thread to wake (docs/benchmarks.md#openmp-threads).
        self.async_steps: AsyncSteps | None = None
        if self.scheduler_config.async_scheduling:
            self.async_steps = AsyncSteps(self._execute_model, self._sample_tokens)
            # The step thread starts first, at the engine's priority; then every other thread
            # of the engine (and those it starts later: vLLM's input and output threads) yields
            # to it and its OpenMP team (plugin/front_end.py). Only where this worker runs in
            # the engine's process: a rank of vLLM's multiprocess executor has its own process,
            # whose main thread hands it each step.
            if self.parallel_config.world_size == 1:
                step_thread = self.async_steps.native_id()
                lower_python_threads(front_end_nice(), keep=(step_thread,))
                if front_end:  # the OpenMP team the step thread starts inherits its cores
                    pin_threads([step_thread], compute)
                    pin_threads(python_threads(keep=(step_thread,)), front_end)
                    logger.info(
                        "vllm-aot: the steps run on cores %s, the front end on %s (%s)",
                        list(compute),
                        list(front_end),
                        RESERVED_ENV,
                    )
        self.clock = StepClock()
        validate_worker_profiler_config(self.vllm_config.profiler_config)

    def load_model(self, *args, **kwargs) -> None:
        self._on_step_thread(self._load_model)

    def _on_step_thread(self, fn, *args):
        """`fn(*args)` where the steps run: the step thread under async scheduling."""
        if self.async_steps is not None:
            return self.async_steps.call(fn, *args)
        return fn(*args)

    def _load_model(self) -> None:
        options = self.options
        program_options = ProgramOptions(
            cache=ProgramCache(options.cache_settings()),
            allow_compile=not options.require_cached,
            progress_to=_log_progress,
            on_event=_log_program,
        )
        self.loaded = start(
            options.artifact_dir or self.model_config.model,
            options.runtime,
            program_options,
            rank=self.place.tp_rank,
        )
        self.arch = self.loaded.arch
        self.draft_loaded = None  # a draft model of its own (speculative decoding)
        if options.draft_model is not None:
            runtime = options.runtime.for_draft()
            self.draft_loaded = start(options.draft_model, runtime, program_options)
        if self.arch.is_moe:
            rank = options.runtime.rank(self.place.tp_rank)
            logger.info("vllm-aot: rank %d holds %s", rank.index, rank_share(self.arch, rank))
        if options.stats_file:
            self.stats_file = StatsFile(
                options.stats_file, load_stats(self.loaded.report, self.loaded.config)
            )

    def get_kv_cache_spec(self) -> dict:
        return kv_cache_spec(self.local_arch, self.options.runtime)

    @property
    def local_arch(self) -> ModelArch:
        """This rank's share of the model (its KV heads)."""
        return self.options.runtime.rank_arch(self.arch)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # ours: [layer][block][position][head][dim]

    def determine_available_memory(self) -> int:
        """KV budget: VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes when set, else
        --gpu-memory-utilization of this machine's memory minus what this process uses, capped
        at twice what max_num_seqs full-length sequences need (the rest would be zeroed memory
        that only the prefix cache could ever use). A draft model's pool, of as many blocks,
        takes its share of the budget."""
        if self.arch.is_encoder:
            return 0
        runtime = self.options.runtime

        def kv_bytes_per_token(arch: ModelArch) -> int:  # K and V of every layer
            return 2 * arch.num_layers * arch.kv_size * runtime.kv_torch_dtype.itemsize

        bytes_per_token = kv_bytes_per_token(self.local_arch)
        draft_bytes = 0 if self.draft_loaded is None else kv_bytes_per_token(self.draft_loaded.arch)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            return int(explicit) * bytes_per_token // (bytes_per_token + draft_bytes)
        total = psutil.virtual_memory().total
        used = psutil.Process().memory_info().rss
        budget = max(0, int(total * self.cache_config.gpu_memory_utilization) - used)
        budget = budget * bytes_per_token // (bytes_per_token + draft_bytes)
        useful = 2 * runtime.max_num_seqs * runtime.max_model_len * bytes_per_token
        return min(budget, useful)

    def initialize_from_config(self, kv_cache_config) -> None:
        self._on_step_thread(self._initialize_from_config, kv_cache_config)

    def _initialize_from_config(self, kv_cache_config) -> None:
        self.model = self.loaded.build(kv_cache_config.num_blocks)
        if self.stats_file is not None:
            self.stats_file.follow(functools.partial(model_stats, self.model, self.clock))
        self.runner = self._make_runner()
        if self.arch.is_encoder:
            return
        logger.info(
            "vllm-aot: KV pool of %d blocks of %s",
            kv_cache_config.num_blocks,
            self.options.runtime.kv_torch_dtype,
        )

    def _make_runner(self) -> AotModelRunner | PoolingRunner | DecoderPoolingRunner:
        """Generation's runner, or a pooling one: an encoder's, a converted decoder's."""
        if not self.is_pooling:
            return AotModelRunner(self.model, self._make_drafter())
        pooling = self.model_config.pooler_config.seq_pooling_type
        kind = "encoder, no KV cache" if self.arch.is_encoder else "decoder, --convert embed"
        logger.info("vllm-aot: embeddings by %s pooling (%s)", pooling, kind)
        runner = PoolingRunner if self.arch.is_encoder else DecoderPoolingRunner
        return runner(self.model, pooling)

    def _make_drafter(self) -> Drafter | None:
        """Speculative decoding's drafter (`plugin/spec_decode.py`), a draft model built with a
        pool of as many blocks as the target's."""
        draft_model = None
        if self.draft_loaded is not None:
            draft_model = self.draft_loaded.build(self.model.kv.num_blocks)
        return make_drafter(self.vllm_config, self.options.runtime, draft_model)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(
            language_model=sum(self.loaded.report.compiled.values()), encoder=0.0
        )

    def get_supported_tasks(self):
        """Embeddings (`/v1/embeddings`, `/pooling`, `/score`) for a pooling model (an encoder,
        or a decoder under --convert embed), else generation."""
        return ("embed",) if self.is_pooling else ("generate",)

    @property
    def is_pooling(self) -> bool:
        return self.options.runtime.runner == "pooling"

    def execute_model(self, scheduler_output):
        if self.async_steps is not None:
            return self.async_steps.execute_model(scheduler_output)
        return self._execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        if self.async_steps is not None:
            return self.async_steps.sample_tokens(grammar_output)
        return self._sample_tokens(grammar_output)

    def _execute_model(self, scheduler_output):
        if self.profiler is not None:
            self.profiler.step()  # delayed starts, iteration limits, schedules
            self.model.spans.is_enabled = self.profiler.is_recording
        with self._timed("execute_model"):
            return self.runner.execute_model(scheduler_output)

    def _sample_tokens(self, grammar_output):
        with self._timed("sample_tokens"):
            return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        """The next step's drafts (speculative decoding), once; None without."""
        return self.runner.take_draft_token_ids()

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        """A step call on the clock (`/metrics`) and, while profiled, a named range."""
        with self.clock.timed(is_running=bool(self.runner.requests)), self.model.spans(name):
            yield

    def profile(self, *args, **kwargs) -> None:
        """Start or stop a torch profiler session (vLLM's `/start_profile`, `/stop_profile`),
        on the thread that runs the steps (`_profile`)."""
        return self._on_step_thread(functools.partial(self._profile, *args, **kwargs))

    def _profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        """Raises RuntimeError when `--profiler-config` did not enable the torch profiler."""
        config = self.vllm_config.profiler_config
        if config is None or config.profiler is None:
            raise RuntimeError(
                "Profiling is not enabled; pass --profiler-config "
                '\'{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}\''
            )
        if is_start:
            validate_profile_prefix(profile_prefix)
            if self.profiler is None:
                self.profiler = WorkerProfiler(config, rank=self.rank)
            name = f"vllm_aot_rank{self.rank}"
            self.profiler.start(
                f"{profile_prefix}_{name}" if profile_prefix else name,
                delay_iterations=delay_iterations,
                max_iterations=max_iterations,
            )
        elif self.profiler is None:
            logger.warning("vllm-aot: the profiler was not started; nothing to stop")
            return
        else:
            self.profiler.stop()
        self.model.spans.is_enabled = self.profiler.is_recording

    def get_model(self):
        return self.model

    # What vLLM's engine asks of every worker beyond the steps (`/pause`, sleep mode, auto-fit,
    # data parallelism), as vLLM's CPU worker answers it: a CPU has no device memory to free.

    def reset_encoder_cache(self) -> None:
        """`/pause`, `/reset_encoder_cache`: no encoder outputs are cached (multimodal models
        are refused at start)."""

    def sleep(self, level: int = 1) -> None:
        """`/sleep`: the weights and the KV pool stay in memory, as on vLLM's CPU worker; the
        engine's scheduler is paused until `/wake_up`."""
        logger.warning("vllm-aot: sleep level %d keeps weights and KV pool in memory on CPU", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """`/wake_up`: nothing was released (`sleep`)."""

    def discard(self, tags: tuple[str, ...]) -> None:
        """`/release_kv_cache_memory` (tags `("kv_cache",)`): the pool stays allocated. vLLM
        calls it once the engine is paused with no request left and the prefix cache reset, so
        no block holds anything a request reads; kept requests recompute after `/wake_up`."""
        logger.warning("vllm-aot: %s stays in memory on CPU", ", ".join(tags))

    def update_max_model_len(self, max_model_len: int) -> None:
        """vLLM's auto-fit (`--max-model-len -1`) lowered the length to what the KV budget
        holds, before `initialize_from_config`; the compiled programs serve any length up to
        the compiled one."""
        self.model_config.max_model_len = max_model_len
        logger.info("vllm-aot: max_model_len %d, fitted to the KV budget", max_model_len)

    def execute_dummy_batch(self) -> None:
        """An idle rank's step under vLLM's data parallelism, which is refused at start (`vllm-aot
        serve --data-parallel-size` runs independent replicas): no collective to join."""

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        if self.async_steps is not None:
            self.async_steps.shutdown()
        if self.profiler is not None:
            self.profiler.shutdown()
        if self.stats_file is not None:
            self.stats_file.close()
        self.runner = None
