"""Exported artifact directories: compiled programs + manifest + the model's small files.

Layout of `vllm-aot export MODEL -o DIR`:

    DIR/vllm-aot-manifest.json   format, versions, CPU target and kernels, architecture,
                                 RuntimeConfig, program list, where the weights are; written
                                 last, so its presence means the export is complete
    DIR/programs/*.pt2           one AOTInductor package per program (code only, no weights)
    DIR/config.json, tokenizer*  copied, so DIR is also an HF directory for tokenizers and vLLM
    DIR/*.safetensors            only with --copy-weights (the `*.gguf` under quantization
                                 "gguf"); otherwise the manifest references the source
                                 directory

Weights never live inside programs: they are loaded once at start-up and shared by all buckets.
Compiled code runs only where it was built for: `open_artifact` refuses, before anything loads,
a directory exported by another vllm-aot or torch, for another CPU target (its code would die of
an illegal instruction here) or calling other kernels than this machine runs.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vllm_aot
from vllm_aot.cache.keys import arch_digest, cpu_target
from vllm_aot.files import staged_path, write_json_atomic
from vllm_aot.kernels import program_kernels
from vllm_aot.loading.program_sources import (
    LoadReport,
    ProgramOptions,
    check_fits,
    ensure_programs,
    with_checkpoint_formats,
)
from vllm_aot.models.gguf import find_gguf
from vllm_aot.models.source import load_arch, tokenizer_dir
from vllm_aot.runtime.config import RuntimeConfig
from vllm_aot.runtime.programs import ProgramKey, all_program_keys

MANIFEST_NAME = "vllm-aot-manifest.json"
# 2: the manifest names the CPU target and the kernels the programs call.
ARTIFACT_FORMAT = 2
_SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class ArtifactMismatchError(ValueError):
    """An artifact directory does not fit this library, compiler or requested configuration."""


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    compile_seconds: dict[str, float] = field(default_factory=dict)
    total_seconds: float = 0.0


def is_artifact_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def read_manifest(artifact_dir: str | Path) -> dict[str, Any]:
    """The manifest of an exported directory this installation can load on this machine; raises
    ArtifactMismatchError naming what differs (and what to do) otherwise, FileNotFoundError when
    `artifact_dir` is not an exported directory. Serve's front end reads it first, so a mismatch
    stops it before any engine starts."""
    path = Path(artifact_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{artifact_dir} is not an exported vllm-aot artifact (no {MANIFEST_NAME})"
        )
    manifest = json.loads(path.read_text())
    _check_compatible(manifest, Path(artifact_dir))
    _check_kernels(manifest, Path(artifact_dir))
    return manifest


def weights_dir(artifact_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Where an artifact's weights are: copied into it, or the source directory it references."""
    weights = manifest["weights"]
    return Path(artifact_dir) if weights["copied"] else Path(weights["source"])


def export_model(
    model_dir: str | Path,
    out_dir: str | Path,
    config: RuntimeConfig,
    *,
    copy_weights: bool = False,
    **options,
) -> ExportReport:
    """Every program of `config`, from the compile cache or compiled into it, copied into
    `out_dir` and described in a manifest (written last); `options` as `ProgramOptions`."""
    if config.backend != "inductor":
        raise ValueError("export compiles programs: use backend='inductor'")
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir)
    arch = load_arch(model_dir)
    config = with_checkpoint_formats(config, model_dir)
    check_fits(arch, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # incomplete until rewritten
    report = LoadReport()
    paths = ensure_programs(arch, config, report, ProgramOptions(**options))
    (out_dir / "programs").mkdir(exist_ok=True)
    for key, source in paths.items():
        _link_or_copy(source, program_path(out_dir / "programs", key))
    small_files = tokenizer_dir(model_dir)  # a .gguf's: its companion directory
    for name in _SMALL_FILES:
        if (small_files / name).is_file():
            shutil.copy2(small_files / name, out_dir / name)
    if copy_weights:
        for path in _weight_files(model_dir, config):
            shutil.copy2(path, out_dir / path.name)
    manifest = {
        "format": ARTIFACT_FORMAT,
        "vllm_aot_version": vllm_aot.__version__,
        "torch_version": torch.__version__,
        "cpu_target": cpu_target(),
        "kernels": program_kernels(config.formats_used()),
        "architecture": arch.architecture,
        "arch_digest": arch_digest(arch),
        "config": config.to_dict(),
        "programs": sorted(k.name for k in all_program_keys(config)),
        "weights": {"copied": copy_weights, "source": str(model_dir)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json_atomic(out_dir / MANIFEST_NAME, manifest)
    return ExportReport(out_dir, report.compiled, time.perf_counter() - start)


def _weight_files(model_dir: Path, config: RuntimeConfig) -> list[Path]:
    """The files `config`'s checkpoint reads: the directory's GGUF, or its safetensors."""
    if config.quantization == "gguf":
        return [find_gguf(model_dir)]
    return [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link a cached program into an export (same file system), else copy it."""
    with staged_path(target) as staging:
        try:
            os.link(source, staging)
        except OSError:
            shutil.copyfile(source, staging)


def program_path(programs_dir: Path, key: ProgramKey) -> Path:
    """Where an exported directory keeps a program."""
    return programs_dir / f"{key.name}.pt2"


def missing_programs(config: RuntimeConfig, programs_dir: Path) -> list[ProgramKey]:
    """Programs of `config` with no compiled package in `programs_dir`."""
    return [k for k in all_program_keys(config) if not program_path(programs_dir, k).is_file()]


def artifact_program_paths(
    artifact_dir: Path, config: RuntimeConfig, report: LoadReport
) -> dict[ProgramKey, Path]:
    """The exported programs of `config`, recorded in `report`; FileNotFoundError naming any
    that are missing."""
    programs_dir = Path(artifact_dir) / "programs"
    missing = [k.name for k in missing_programs(config, programs_dir)]
    if missing:
        raise FileNotFoundError(f"{programs_dir} lacks compiled programs: {', '.join(missing)}")
    paths = {key: program_path(programs_dir, key) for key in all_program_keys(config)}
    for key in paths:
        report.record(key.name, "artifact")
    return paths


def _check_compatible(manifest: dict[str, Any], artifact_dir: Path) -> None:
    found = {
        "artifact format": (manifest.get("format"), ARTIFACT_FORMAT),
        "vllm-aot": (manifest.get("vllm_aot_version"), vllm_aot.__version__),
        "torch": (manifest.get("torch_version"), torch.__version__),
    }
    wrong = [
        f"{name} {have} (this is {want})" for name, (have, want) in found.items() if have != want
    ]
    if wrong:
        raise ArtifactMismatchError(
            f"{artifact_dir} was compiled with {', '.join(wrong)}; compiled programs only load "
            "with the versions that built them. Re-export it with this installation."
        )
    if manifest.get("cpu_target") != cpu_target():
        raise ArtifactMismatchError(
            f"{artifact_dir} was compiled for CPU target {manifest.get('cpu_target')} and this "
            f"machine is {cpu_target()}; compiled code runs only on the target it was built for "
            "(elsewhere it may stop on an illegal instruction). Re-export it on this machine "
            "(vllm-aot export MODEL -o DIR), or serve the model directory itself."
        )


def _check_kernels(manifest: dict[str, Any], artifact_dir: Path) -> None:
    here = program_kernels(RuntimeConfig.from_dict(manifest["config"]).formats_used())
    if manifest.get("kernels") != here:
        raise ArtifactMismatchError(
            f"{artifact_dir}'s programs call the kernels {manifest.get('kernels')}, and this "
            f"machine runs {here} (VLLM_AOT_KERNELS, or a CPU without AVX2 or with bfloat16 "
            "arithmetic). Re-export it on this machine with the same setting."
        )


def _check_config(manifest_config: RuntimeConfig, expected: RuntimeConfig, artifact_dir: Path):
    have, want = manifest_config.shape_fields(), expected.shape_fields()
    if not expected.has_resolved_formats:  # gguf asked as such: the export read the file's formats
        want["weight_formats"] = have["weight_formats"]
        want["layer_groups"] = have["layer_groups"]
    differing = [f"{k}={have[k]!r} (asked {want[k]!r})" for k in have if have[k] != want[k]]
    if differing:
        raise ArtifactMismatchError(
            f"{artifact_dir} was compiled for a different configuration: {'; '.join(differing)}. "
            "Use its configuration or export again with the one you need."
        )


def open_artifact(
    artifact_dir: str | Path, expected: RuntimeConfig | None = None
) -> tuple[RuntimeConfig, Path]:
    """An exported directory's configuration and where its weights are, checked before anything
    loads.

    Raises ArtifactMismatchError when it was built by another vllm-aot/torch version, for another
    CPU target or kernels, or for a configuration other than `expected` (when given);
    FileNotFoundError when its weights are gone.
    """
    artifact_dir = Path(artifact_dir)
    manifest = read_manifest(artifact_dir)
    config = RuntimeConfig.from_dict(manifest["config"])
    if expected is not None:
        _check_config(config, expected, artifact_dir)
        config = expected
    weights_path = weights_dir(artifact_dir, manifest)
    if not weights_path.is_dir():
        raise FileNotFoundError(
            f"{artifact_dir} references weights in {weights_path}, which does not exist; "
            "export with --copy-weights to make a self-contained directory"
        )
    return config, weights_path
