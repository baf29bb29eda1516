"""The one start-up path: a model (HF directory, `.gguf` file or exported directory) and a
configuration ->
programs and weights -> `CompiledModel`.

Every caller starts a model here: the vLLM worker, the CLI (`demo`, `validate`, `tensors`),
benchmarks and tests. The order is fixed: what the source is (an exported directory fixes its
configuration and never compiles), a GGUF's weight formats read from its file (quantization
"gguf", which a `.gguf` file implies, with none given), the fit check, the programs (exported, or
from the compile cache, compiling what is missing unless `allow_compile` is False; before any,
the kernels library they call: `prebuilt.py`), the weights, one summary line.
vLLM sizes the KV pool only after loading, so `start` returns the loaded parts and
`LoadedModel.build(num_kv_blocks)` makes the model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_aot.cache.program_cache import CacheSettings, ProgramCache
from vllm_aot.loading.export_dir import artifact_program_paths, is_artifact_dir, open_artifact
from vllm_aot.loading.program_sources import (
    LoadReport,
    ProgramOptions,
    check_fits,
    ensure_programs,
    load_programs,
    load_weights_timed,
    prepare_kernels,
    with_checkpoint_formats,
)
from vllm_aot.models.config import ModelArch
from vllm_aot.models.source import load_arch
from vllm_aot.models.weights import ModelWeights
from vllm_aot.runtime.backends import Program
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.encoder import EncoderModel
from vllm_aot.runtime.model import CompiledModel
from vllm_aot.runtime.programs import ProgramKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """What start-up loaded; the KV pool is sized when the model is built."""

    arch: ModelArch
    config: RuntimeConfig
    weights: ModelWeights
    programs: dict[ProgramKey, Program]
    report: LoadReport

    def build(self, num_kv_blocks: int | None = None) -> CompiledModel | EncoderModel:
        """The model with a KV pool of `num_kv_blocks` blocks (default: the config's); an
        encoder's has none."""
        if self.arch.is_encoder:
            return EncoderModel(self.arch, self.config, self.weights, self.programs)
        return CompiledModel(
            self.arch, self.config, self.weights, self.programs, num_kv_blocks=num_kv_blocks
        )


def start(
    source: str | Path,
    config: RuntimeConfig | None = None,
    options: ProgramOptions | None = None,
    *,
    rank: int = 0,
) -> LoadedModel:
    """Load `source` under `config` (an exported directory's own when None), its programs as
    `options` say, and tensor-parallel rank `rank`'s weights (of the config's
    `tensor_parallel_size`; every rank loads the same programs).

    Raises ValueError naming the limit when the model cannot honour `config`,
    ArtifactMismatchError for an exported directory built elsewhere or for another
    configuration, CacheMissError when a program is missing and compiling is not allowed.
    """
    report = LoadReport()
    options = options or ProgramOptions()
    is_exported = config is None or is_artifact_dir(source)
    if is_exported:  # FileNotFoundError when `source` is not one
        config, weights_path = open_artifact(source, expected=config)
    else:
        weights_path = Path(source)
    arch = load_arch(source)
    config = with_checkpoint_formats(config, weights_path)
    check_fits(arch, config)
    if config.num_layer_groups > 1:
        logger.info("vllm-aot: %s", config.groups_summary(arch.num_layers))
    options = replace(options, cache=options.cache or ProgramCache(CacheSettings.from_env()))
    paths = None
    if config.backend == "inductor" and not is_exported:
        paths = ensure_programs(arch, config, report, options)  # the kernels first
    else:
        prepare_kernels(options.cache, config, report)
        if config.backend == "inductor":
            paths = artifact_program_paths(Path(source), config, report)
    programs = load_programs(arch, config, paths, report)
    weights = load_weights_timed(weights_path, arch, config, report, rank)
    logger.info("vllm-aot: model ready: %s", report.summary())
    return LoadedModel(arch, config, weights, programs, report)


def load_model(
    source: str | Path, config: RuntimeConfig | None = None, *, rank: int = 0, **options
) -> tuple[CompiledModel | EncoderModel, LoadReport]:
    """`start` of `rank` with `ProgramOptions(**options)`, built with the config's KV pool."""
    loaded = start(source, config, ProgramOptions(**options), rank=rank)
    return loaded.build(), loaded.report
