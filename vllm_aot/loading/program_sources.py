"""A configuration's programs (from the compile cache, compiled, or exported) and weights, with a
report of where each came from and what it cost. `startup.py` puts them together."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.loading.prebuilt import ensure_kernels
from vllm_aot.loading.progress import CompileProgress
from vllm_aot.models.checkpoints import resolve_weight_formats
from vllm_aot.models.config import ModelArch
from vllm_aot.models.source import implied_quantization
from vllm_aot.models.weights import ModelWeights, load_weights
from vllm_aot.placement import available_cores
from vllm_aot.runtime.backends import Program, eager_program, load_program
from vllm_aot.runtime.compiler import compile_programs
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, all_program_keys


@dataclass
class LoadReport:
    """What start-up did, per program: where it came from and how long it took."""

    sources: dict[str, str] = field(default_factory=dict)  # local | remote | compiled | artifact
    seconds: dict[str, float] = field(default_factory=dict)  # to look up, fetch or compile each
    loaded: dict[str, float] = field(default_factory=dict)  # load seconds (every program)
    weights_seconds: float = 0.0
    weights_bytes: int = 0
    kernels: str | None = None  # the kernels library: local | remote | built (None: not used)
    kernels_seconds: float = 0.0  # to find, fetch or build it, and load it

    def record(self, name: str, source: str, seconds: float = 0.0) -> None:
        self.sources[name] = source
        self.seconds[name] = seconds

    def count(self, source: str) -> int:
        return sum(s == source for s in self.sources.values())

    def _seconds_of(self, source: str) -> dict[str, float]:
        return {n: self.seconds[n] for n, s in self.sources.items() if s == source}

    @property
    def compiled(self) -> dict[str, float]:
        """Compile seconds of the programs this start compiled."""
        return self._seconds_of("compiled")

    @property
    def fetched(self) -> dict[str, float]:
        """Fetch seconds of the programs taken from the remote store."""
        return self._seconds_of("remote")

    def summary(self) -> str:
        origin = ", ".join(
            f"{self.count(s)} {label}"
            for s, label in (
                ("local", "from the local cache"),
                ("remote", "fetched from the remote store"),
                ("compiled", "compiled"),
                ("artifact", "from the exported directory"),
            )
            if self.count(s)
        )
        kernels = {
            "local": "kernels from this machine",
            "remote": "kernels fetched from the remote store",
            "built": "kernels built",
        }.get(self.kernels or "")
        return (
            f"{len(self.loaded)} programs loaded in {sum(self.loaded.values()):.2f} s"
            f"{f' ({origin})' if origin else ''}; compile {sum(self.compiled.values()):.1f} s, "
            f"fetch {sum(self.fetched.values()):.2f} s; weights {self.weights_bytes / 1e6:.0f} MB "
            f"in {self.weights_seconds:.2f} s"
            + (f"; {kernels} in {self.kernels_seconds:.2f} s" if kernels else "")
        )


def default_num_workers() -> int:
    return max(1, min(len(available_cores()), 8))


@dataclass(frozen=True)
class ProgramOptions:
    """Where a configuration's programs come from, and what a person sees while they do."""

    cache: ProgramCache | None = None  # default: the cache the environment names
    allow_compile: bool = True  # False: a missing program raises CacheMissError
    num_workers: int | None = None  # parallel compiles (default: cores, at most 8)
    show_progress: bool = True  # one progress line while compiling
    progress_to: Callable[[str], None] | None = None  # where it goes (default: the terminal)
    on_event: Callable[[str, str, float], None] | None = None  # (name, source, seconds)


def ensure_programs(
    arch: ModelArch,
    config: RuntimeConfig,
    report: LoadReport,
    options: ProgramOptions = ProgramOptions(),
) -> dict[ProgramKey, Path]:
    """Every program of `config` from the compile cache (local, remote) or compiled into it,
    recorded in `report`, after the kernels library they call (`prepare_kernels`). Raises
    CacheMissError when a program is missing and compiling is not allowed."""
    cache = options.cache or ProgramCache(CacheSettings.from_env())
    prepare_kernels(cache, config, report)
    num_workers = options.num_workers or default_num_workers()

    def compile_fn(jobs, on_done) -> None:
        progress = None
        if options.show_progress:
            groups = Counter(key.group for key, _ in jobs if key.is_layer)
            progress = CompileProgress(len(jobs), write=options.progress_to, groups=groups)

        def done(key: ProgramKey, seconds: float) -> None:
            on_done(key, seconds)
            if progress is not None:
                progress.update(key.group if key.is_layer else None)

        compile_programs(jobs, arch, config, num_workers=num_workers, on_done=done)

    def event(name: str, source: str, seconds: float) -> None:
        report.record(name, source, seconds)
        if options.on_event is not None:
            options.on_event(name, source, seconds)

    outcome = cache.ensure(
        arch, config, compile_fn=compile_fn if options.allow_compile else None, on_event=event
    )
    return outcome.paths


def prepare_kernels(cache: ProgramCache, config: RuntimeConfig, report: LoadReport) -> None:
    """The kernels library programs of `config` call, loaded into this process (installed here,
    fetched from the remote store or built: `prebuilt.ensure_kernels`), timed into `report`."""
    start = time.perf_counter()
    report.kernels = ensure_kernels(cache, config.formats_used())
    report.kernels_seconds = time.perf_counter() - start


def load_programs(
    arch: ModelArch,
    config: RuntimeConfig,
    program_paths: dict[ProgramKey, Path] | None,
    report: LoadReport,
) -> dict[ProgramKey, Program]:
    """Every program of `config`: eager modules, or the compiled packages at `program_paths`."""
    keys = all_program_keys(config)
    if config.backend == "eager":
        return {key: eager_program(key, arch, config) for key in keys}
    assert program_paths is not None, "the inductor backend loads compiled programs"
    programs = {}
    with _without_isa_probe():
        for key in keys:
            start = time.perf_counter()
            programs[key] = load_program(program_paths[key], config)
            report.loaded[key.name] = time.perf_counter() - start
    return programs


@contextlib.contextmanager
def _without_isa_probe() -> Iterator[None]:
    """torch's package loader compares the device a package was compiled for with this one only
    to log a mismatch, and learns this CPU's vector ISA by compiling a probe program per ISA (g++,
    seconds on a fresh machine; nothing a machine that only loads programs should need). The
    target is already guaranteed (it is in every cache key and exported manifest), so the
    comparison is skipped while programs load."""
    from torch._inductor import codecache

    compared = codecache.get_device_information
    codecache.get_device_information = lambda device_type: {}
    try:
        yield
    finally:
        codecache.get_device_information = compared


def with_checkpoint_formats(config: RuntimeConfig, model_dir: str | Path) -> RuntimeConfig:
    """`config` with the weight formats its checkpoint stores, when it leaves them to the file
    (quantization "gguf", which a `.gguf` file implies, with none given); unchanged otherwise."""
    quantization = implied_quantization(model_dir, config.quantization)
    if quantization != config.quantization:
        config = replace(config, quantization=quantization)
    if config.has_resolved_formats:
        return config
    formats = resolve_weight_formats(model_dir, config.quantization, config.torch_dtype)
    return replace(config, **formats._asdict())


def load_weights_timed(
    model_dir: str | Path,
    arch: ModelArch,
    config: RuntimeConfig,
    report: LoadReport,
    rank: int = 0,
) -> ModelWeights:
    """Tensor-parallel rank `rank`'s weights (of `config.tensor_parallel_size`; an MoE
    model's experts split by expert under `config.enable_expert_parallel`)."""
    start = time.perf_counter()
    weights = load_weights(
        model_dir,
        arch,
        config.torch_dtype,
        formats=config.linear_format,
        layer_formats=config.layer_formats,
        quantization=config.quantization,
        rank=config.rank(rank),
    )
    report.weights_seconds = time.perf_counter() - start
    report.weights_bytes = weights.num_bytes()
    return weights


def check_fits(arch: ModelArch, config: RuntimeConfig) -> None:
    """Refuse configurations the model cannot honour, naming the limit."""
    if config.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    if arch.sliding_window is not None and arch.sliding_window < config.max_model_len:
        raise ValueError(
            f"{arch.architecture} uses a sliding window of {arch.sliding_window} tokens, which "
            f"vllm-aot does not implement; use max_model_len <= {arch.sliding_window}"
        )
    config.rank_arch(arch)  # ValueError naming what does not split
    beyond = [i for layers, _ in config.layer_groups for i in layers if i >= arch.num_layers]
    if beyond:
        raise ValueError(f"layer_groups name layers {beyond}; the model has {arch.num_layers}")
    if arch.is_encoder and (config.runner != "pooling" or config.convert is not None):
        raise ValueError(
            f"{arch.architecture} is an encoder: it serves runner 'pooling' (embeddings) as it "
            f"is, not runner {config.runner!r} with convert {config.convert!r}"
        )
    if not arch.is_encoder and config.runner == "pooling" and config.convert != "embed":
        raise ValueError(
            f"runner 'pooling' for the decoder {arch.architecture} needs convert 'embed' "
            "(vLLM's --convert embed)"
        )
