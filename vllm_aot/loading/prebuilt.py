"""What a start needs besides programs, from the cheapest place that has it: the kernels library,
the bundled model and vLLM's records of inspected model classes, present on this machine, else
fetched from the remote store, else built (the kernels, ~20 s), converted (the model) or left to
vLLM (which inspects a model class in a fresh interpreter, ~10 s).

They are named in the store by what they are: `artefacts/kernels/<build digest>` (the library
and its record; `kernels.build_fingerprint`), `artefacts/models/<prepared digest>` (the bundled
model's HF directory; `models.prepare.prepared_digest`: its GGUF and the conversion's version) and
`artefacts/vllm-modelinfos/<digest of vLLM's version>` (`VLLM_CACHE_ROOT/modelinfos`; vLLM checks
each record against the hash of its own model file before using it).
A fetch runs under the lock a build or conversion takes, is verified (each file's sha256 recorded
at upload, then the library's record or the model's marker) and renamed into place whole. They
are uploaded where programs are: by a start with uploading configured (`VLLM_AOT_CACHE_UPLOAD=1`,
`--cache-upload`) when the store lacks them, and by `vllm-aot cache sync`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from collections.abc import Iterable
from pathlib import Path

from vllm_aot import kernels, paths
from vllm_aot.cache.program_cache import ProgramCache
from vllm_aot.cache.remote_artefacts import artefact_name, fetch_tree, has_tree, push_tree
from vllm_aot.cache.remote_tier import RemoteTier
from vllm_aot.files import exclusive_lock
from vllm_aot.models.prepare import (
    default_model_dir,
    find_default_gguf,
    is_prepared,
    prepare_default_model,
    prepared_digest,
    recorded_digest,
)

logger = logging.getLogger(__name__)


def _kernels_name() -> str:
    return artefact_name("kernels", kernels.build_digest())


def _model_name(digest: str) -> str:
    return artefact_name("models", digest)


def _model_infos_name() -> str:
    distributions = importlib.metadata.packages_distributions().get("vllm", ["vllm"])
    version = f"{distributions[0]} {importlib.metadata.version(distributions[0])}"
    return artefact_name("vllm-modelinfos", hashlib.sha256(version.encode()).hexdigest()[:16])


def ensure_model_infos(cache: ProgramCache) -> str:
    """vLLM's records of inspected model classes: "local" (this machine has some), "remote"
    (fetched) or "none" (vLLM inspects the class itself). Uploaded when uploading is configured
    and the store lacks them."""
    directory = paths.vllm_model_infos_dir()
    origin = "local" if any(directory.glob("*.json")) else "none"
    if origin == "none" and cache.remote is not None and _fetch_model_infos(cache.remote):
        origin = "remote"
    if cache.settings.upload:
        _push_model_infos(cache)
    return origin


def ensure_kernels(cache: ProgramCache, formats: Iterable[str]) -> str | None:
    """Load the kernels library that programs whose linears use `formats` call; return where it
    came from: "local" (installed here), "remote" (fetched) or "built"; None when they call
    none."""
    if not kernels.uses_library(formats):
        return None
    origin = "local"
    fetch = kernels.installed_library() is None and cache.remote is not None
    if fetch and _fetch_kernels(cache.remote):
        origin = "remote"
    if kernels.load() == "built":
        origin = "built"
    if cache.settings.upload:
        _push_kernels(cache)
    return origin


def bundled_model(cache: ProgramCache) -> tuple[Path, str]:
    """The bundled model's HF directory and where it came from: "local" (prepared here before),
    "remote" (fetched) or "converted" from its GGUF. Uploaded when uploading is configured and
    the store lacks it."""
    fetched = []

    def fetch(digest: str, target: Path) -> bool:
        if cache.remote is None:
            return False
        fetched.append(
            fetch_tree(
                cache.remote,
                _model_name(digest),
                target,
                accept=lambda staged: is_prepared(staged, digest),
            )
        )
        return fetched[-1]

    was_prepared = is_prepared(default_model_dir())
    model_dir = prepare_default_model(fetch=fetch)
    if cache.settings.upload:
        _push_model(cache)
    origin = "local" if was_prepared else "remote" if any(fetched) else "converted"
    return model_dir, origin


def sync_artefacts(cache: ProgramCache, *, push: bool, pull: bool) -> tuple[int, int]:
    """`cache sync` for the start-up artefacts: push what is here and not in the store, fetch
    what the store has and this machine lacks; returns (pushed, pulled)."""
    if cache.remote is None:
        return 0, 0
    pushed = _push_kernels(cache) + _push_model(cache) + _push_model_infos(cache) if push else 0
    pulled = 0
    if pull and kernels.kernels_enabled() and kernels.installed_library() is None:
        pulled += _fetch_kernels(cache.remote)
    if pull and not any(paths.vllm_model_infos_dir().glob("*.json")):
        pulled += _fetch_model_infos(cache.remote)
    if pull and not is_prepared(default_model_dir()):
        try:
            digest = prepared_digest(find_default_gguf())
        except FileNotFoundError:  # no bundled GGUF installed here: nothing to prepare
            digest = None
        if digest and has_tree(cache.remote, _model_name(digest)):
            pulled += bundled_model(cache)[1] == "remote"
    return pushed, pulled


def _fetch_kernels(store: RemoteTier) -> bool:
    """Install this build's library from `store`, under the build's lock; whether it did."""
    with kernels.install_lock():
        if kernels.installed_library() is not None:
            return False
        return fetch_tree(
            store,
            _kernels_name(),
            kernels.library_dir(),
            accept=lambda staged: kernels.whole_library(staged) is not None,
        )


def _fetch_model_infos(store: RemoteTier) -> bool:
    directory = paths.vllm_model_infos_dir()
    with exclusive_lock(directory.with_name("modelinfos.lock"), what="fetching vLLM's records"):
        return fetch_tree(store, _model_infos_name(), directory)


def _push_model_infos(cache: ProgramCache) -> int:
    directory = paths.vllm_model_infos_dir()
    files = sorted(p.name for p in directory.glob("*.json") if p.is_file())
    return _push(cache, _model_infos_name(), directory, files) if files else 0


def _push_kernels(cache: ProgramCache) -> int:
    if kernels.installed_library() is None:
        return 0
    files = [kernels.LIBRARY_FILE, kernels.RECORD_FILE]
    return _push(cache, _kernels_name(), kernels.library_dir(), files)


def _push_model(cache: ProgramCache) -> int:
    model_dir = default_model_dir()
    if (digest := recorded_digest(model_dir)) is None:
        return 0
    files = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    return _push(cache, _model_name(digest), model_dir, files)


def _push(cache: ProgramCache, name: str, source: Path, files: list[str]) -> int:
    """Upload artefact `name` unless the store has it; 1 when uploaded. A failure is a warning:
    the start goes on, and the next upload tries again."""
    if cache.remote is None:
        return 0
    try:
        if has_tree(cache.remote, name) or not push_tree(cache.remote, name, source, files):
            return 0
    except Exception as exc:  # the remote store is an optimisation, never a reason to fail
        logger.warning("vllm-aot cache: uploading %s to %s failed: %s", name, cache.remote.url, exc)
        return 0
    logger.info("vllm-aot cache: uploaded %s to %s", name, cache.remote.url)
    return 1
