"""Hand-written CPU kernels, as torch custom ops, for what aten and Inductor do poorly here.

- `vllm_aot::linear_bf16(x, w)` (`linear_bf16.cpp`): `x @ w.T` for bfloat16 tensors with float32
  accumulation. On x86 CPUs without native bfloat16 arithmetic (no AVX-512 BF16 or AMX), aten's
  bfloat16 matmul runs far slower than the same product in float32 once more than one row
  multiplies the weights (docs/benchmarks.md#bfloat16-linears); this kernel widens the weights
  in registers and runs at float32 speed while reading half the bytes.
- `vllm_aot::linear_int8|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k(x, *stored)`
  (`linear_<format>.cpp`, sharing `quant.h`; the GGUF K-quants' super-blocks read by
  `quant_k.h`, float32, and `quant_k_fixed.h`, bfloat16 activations as 16-bit fixed point per
  super-block):
  `x @ W.T` straight from a quantised weight's stored tensors (the layouts of `models/formats.py`),
  x float32 or bfloat16, the result in x's dtype. Up to 8 rows (decode at small batch; 32 on the
  AVX2 fixed-point path) the weights stream once, front to back, each block widened in registers
  for all the rows: float32 arithmetic on the activations as they are (`quant_avx2.h`,
  `quant_avx512.h`); for bfloat16 activations of the block formats on AVX2, the codes as int16
  times the activations as 16-bit fixed point per block (`quant_avx2_fixed.h`), and of the 4-bit
  formats on AVX512-VNNI, the codes as bytes times 15-bit fixed point (`quant_avx512_vnni.h`).
  On CPUs with AMX, bfloat16 activations of 5-32 rows (q8_0 and int8 from one row) meet each
  block dequantised once into two bfloat16 tiles (the weight to 2^-16), AMX's tile multiply
  covering 16 rows at once (`quant_amx.h`), so 5 rows cost about what 16 do. More rows
  (prefill) dequantise the weights in chunks for aten's GEMM (`quant.cpp`). A row's result
  never depends on the other rows (`quant.h`).
- `vllm_aot::decode_attention(q, k_new, v_new, k_pool, v_pool, block_tables, context_lens,
  k_scale, v_scale)` (`decode_attention.cpp`): paged attention of one query per row (or n, a
  verify step's newest token and drafts, causal among themselves) that reads only the row's
  real context (pools of q's dtype, or fp8 with the layer's scales), where the pure-torch
  versions (`models.layers.decode_attention` and `verify_attention`, the references) attend
  over the whole static context bucket and Inductor's code for them is mostly gathers.
- `vllm_aot::prefill_attention(q, k_new, v_new, k_pool, v_pool, block_ids, mask, k_scale,
  v_scale)` (`prefill_attention.cpp`): a prefill step's packed tokens against their sequences'
  cached blocks and, causally, their own keys, chunk by chunk of keys with an online softmax,
  reading only the keys each tile of tokens sees, where the reference
  (`models.layers.prefill_attention`, torch's SDPA) computes every token against the whole
  context bucket and every new key, masked.
- `vllm_aot::moe_experts(x, topk_ids, topk_weights, w13, w2, first_expert, use_linear_bf16)`
  (`moe_experts.cpp`): a rank's experts of a sparse MoE block over only the tokens routed to
  them (grouped by expert, gathered, multiplied, weighted and added back), where the pure-torch
  version (`models.layers.moe_experts`, the reference) multiplies every token by every expert to
  keep its shapes static.
- `vllm_aot::logprob_stats(logits, tokens, n)` (`logprob_stats.cpp`): the sampled tokens' raw
  logprobs, ranks and the top-n of each row in three passes over its logits, where the sampler's
  pure-torch version (`runtime.sampler.logprob_stats`, the reference) materialises every logprob
  and sorts for topk.
- `vllm_aot::sample_tokens(logits, vocab_mask, temperature, top_k, top_p, min_p, seeds,
  positions, num_candidates, is_greedy)` (`sample_tokens.cpp`): the head's draw of one token per
  row (greedy, or temperature, min-p, top-k, top-p and the seeded exponential race), where the
  sampler's pure-torch version (`runtime.sampler.draw_tokens`, the reference) builds every row's
  mask, probabilities and uniforms as [rows, vocab] tensors, its hash in int64.
- `ProgramRunner` (`program_runner.cpp`, not an op; `runner.py`): a compiled program run with the
  GIL let go (torch's binding of AOTInductor's runner holds it).

Which implementation a program calls is fixed when it is compiled (`program_kernels`, part of
its cache key): the linear's from its weight format's choice for this CPU (`models/formats.py`
registers the formats and their kernels; `cpu_features()` is what the choice reads), the decode
attention's, the experts' and the head's draw and logprob statistics' here. Compiled programs
call the ops by name, so the library is loaded (`load()`) before any program runs.
`VLLM_AOT_KERNELS=0` turns every kernel off (aten and pure torch only), for debugging and
comparison.

Each `.cpp` file here defines its ops, their CPU implementation and their shape function (a Meta
implementation, which export's fake tensors run); the library is every `.cpp` file of this
folder, built with the machine's C++ compiler (the one Inductor uses) for AVX2 + FMA. Faster
instruction sets are functions compiled for their own target (`__attribute__((target))`) and
chosen at run time from the CPU's features: the quantised linears take AMX (where the CPU has
it and Linux grants the tile state), AVX-512 (with VNNI where the CPU has it), else AVX2;
`VLLM_AOT_KERNEL_ISA=avx512_vnni`, `avx512` or `avx2` (read once per process, by the library)
caps the choice, and `vllm_aot::quant_isa()` names the path taken. It is installed once per
machine in `<cache root>/kernels/<build digest>/` (`library_dir()`; the digest covers the
sources, flags, torch version and machine: `build_fingerprint()`) with a record (`library.json`:
the fingerprint and the library's sha256) written before the directory is renamed into place,
so a directory whose record matches its library is whole (`whole_library`).

`load()` loads the installed library straight from its file, never through torch's builder.
When none is installed it builds one (~20 s) under the build's flock (`install_lock`: it dies
with its process, so a killed build never blocks the next start) in a fresh staging directory,
renamed into place when whole; torch's builder keeps its own lock file in that staging
directory, where a killed build leaves it for the next holder of the flock to remove, unread.
The loading layer may install `library_dir()` from a remote store instead, under the same flock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from vllm_aot.files import (
    exclusive_lock,
    file_sha256,
    remove_staging_leftovers,
    staged_dir,
    write_json_atomic,
)
from vllm_aot.models.experts import REFERENCE_EXPERTS, ExpertsKernel
from vllm_aot.models.formats import weight_format
from vllm_aot.models.linear import CpuFeatures
from vllm_aot.paths import cache_root

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Tuples: torch's builder appends to the lists it is given.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_LIBRARY = "vllm_aot_kernels"
LIBRARY_FILE = f"{_LIBRARY}.so"  # what torch's builder names it
RECORD_FILE = "library.json"
# The decode attention's contract, named in the cache key of every program that calls it.
DECODE_ATTENTION = "vllm_aot.decode_attention/3"
PREFILL_ATTENTION = "vllm_aot.prefill_attention/1"
LOGPROB_STATS = "vllm_aot.logprob_stats/1"
SAMPLE_TOKENS = "vllm_aot.sample_tokens/1"
MOE_EXPERTS = "vllm_aot.moe_experts/1"
TORCH = "torch"
_LIBRARY_OPS = "vllm_aot."  # the prefix of every kernel name that is one of our ops


def kernels_enabled() -> bool:
    """x86-64 with AVX2 and FMA, unless `VLLM_AOT_KERNELS=0`."""
    if os.environ.get("VLLM_AOT_KERNELS", "1") == "0":
        return False
    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_avx2_supported()


def cpu_features() -> CpuFeatures:
    cpu = torch.cpu
    return CpuFeatures(
        can_use_kernels=kernels_enabled(),
        has_native_bf16=cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported(),
    )


def linear_impl(fmt: str) -> str:
    """The kernel linears of weight format `fmt` call on this CPU: the format's choice."""
    return weight_format(fmt).kernel(cpu_features()).name


def attention_impl() -> str:
    """The decode attention our programs use: the kernel wherever kernels build."""
    return DECODE_ATTENTION if kernels_enabled() else TORCH


def prefill_attention_impl() -> str:
    """The prefill attention our programs use: the kernel wherever kernels build."""
    return PREFILL_ATTENTION if kernels_enabled() else TORCH


def logprobs_impl() -> str:
    """What head programs use for the sampled token's logprob, rank and the top-n: the kernel
    wherever kernels build."""
    return LOGPROB_STATS if kernels_enabled() else TORCH


def sampling_impl() -> str:
    """What head programs use to draw their tokens: the kernel wherever kernels build."""
    return SAMPLE_TOKENS if kernels_enabled() else TORCH


def experts_impl() -> str:
    """What layer programs of MoE models use for a rank's experts: the kernel wherever kernels
    build."""
    return MOE_EXPERTS if kernels_enabled() else TORCH


def program_kernels(formats: Iterable[str]) -> dict[str, str]:
    """What programs whose linears use `formats` call on this CPU (their cache key names it):
    `linear.<format>` per format, `attention` (decode's), `prefill_attention`, `experts` (MoE
    layers), `logprobs` and `sampling` (the head's)."""
    linears = {f"linear.{fmt}": linear_impl(fmt) for fmt in sorted(set(formats))}
    return {
        **linears,
        "attention": attention_impl(),
        "prefill_attention": prefill_attention_impl(),
        "experts": experts_impl(),
        "logprobs": logprobs_impl(),
        "sampling": sampling_impl(),
    }


def uses_library(formats: Iterable[str]) -> bool:
    """Whether programs whose linears use `formats` call any of our ops on this CPU."""
    return any(name.startswith(_LIBRARY_OPS) for name in program_kernels(formats).values())


def load_used(formats: Iterable[str]) -> None:
    """Load the library when programs whose linears use `formats` call any of our ops (before
    loading one)."""
    if uses_library(formats):
        load()


def logprob_stats_kernel(impl: str):
    """The kernel head programs call for `runtime.sampler.logprob_stats` (same signature), or
    None where they use that pure-torch function itself."""
    if impl == TORCH:
        return None
    load()
    return torch.ops.vllm_aot.logprob_stats


def sample_tokens_kernel(impl: str):
    """The kernel head programs call for `runtime.sampler.draw_tokens` (same signature), or None
    where they use that pure-torch function itself."""
    if impl == TORCH:
        return None
    load()

    def draw(source, t, is_greedy, num_candidates):
        return torch.ops.vllm_aot.sample_tokens(
            source, t.vocab_mask, t.temperature, t.top_k, t.top_p, t.min_p, t.seeds,
            t.positions, num_candidates, is_greedy,
        )  # fmt: skip

    return draw


def experts_kernel(impl: str) -> ExpertsKernel:
    """What layer programs call for a rank's experts (`models.layers.moe_experts`' signature).
    Its bfloat16 products use `linear_bf16` where the CPU lacks bfloat16 arithmetic, as the bf16
    weight format does (`linear.bf16` in the same cache key)."""
    if impl == TORCH:
        return REFERENCE_EXPERTS
    load()
    use_linear_bf16 = not cpu_features().has_native_bf16

    def apply(x, topk_ids, topk_weights, w13, w2, first_expert):
        return torch.ops.vllm_aot.moe_experts(
            x, topk_ids, topk_weights, w13, w2, first_expert, use_linear_bf16
        )

    return ExpertsKernel(MOE_EXPERTS, apply)


def decode_attention_fn(impl: str, *, verify: bool = False):
    """The function decode programs (and, with `verify`, verify programs: several new tokens a
    row) call for attention (`models.layers.decode_attention`'s signature; `verify_attention`'s
    is the same). The kernel serves both."""
    if impl == TORCH:
        from vllm_aot.models.layers import decode_attention, verify_attention

        return verify_attention if verify else decode_attention
    load()
    return _kernel_decode_attention


def _kernel_decode_attention(q, k_new, v_new, cache, block_tables, context_mask):
    # The mask is a prefix of each row's context bucket: its length is the row's context.
    lengths = context_mask.sum(-1)
    return torch.ops.vllm_aot.decode_attention(
        q, k_new, v_new, cache.k, cache.v, block_tables, lengths, cache.k_scale, cache.v_scale
    )


def prefill_attention_fn(impl: str):
    """The function prefill programs call for attention (`models.layers.prefill_attention`'s
    signature): the kernel, or that reference itself; the reference too for head sizes that are
    not a multiple of 8 (the kernel's registers), decided when the program is traced."""
    from vllm_aot.models.layers import prefill_attention

    if impl == TORCH:
        return prefill_attention
    load()

    def attend(q, k_new, v_new, cache, context_block_ids, mask):
        if q.shape[-1] % 8:
            return prefill_attention(q, k_new, v_new, cache, context_block_ids, mask)
        return torch.ops.vllm_aot.prefill_attention(
            q,
            k_new,
            v_new,
            cache.k,
            cache.v,
            context_block_ids,
            mask,
            cache.k_scale,
            cache.v_scale,
        )

    return attend


def _sources() -> list[Path]:
    return sorted(_HERE.glob("*.cpp"))


def build_fingerprint() -> dict[str, str | list[str]]:
    """What the built library depends on. The target is the machine and the flags' ISA (AVX2 +
    FMA), not the building CPU: no `-march=native`, so any x86-64 with AVX2 runs it."""
    sources = hashlib.sha256()
    for path in [*_sources(), *sorted(_HERE.glob("*.h"))]:
        sources.update(path.name.encode() + b"\n" + path.read_bytes())
    return {
        "sources": sources.hexdigest(),
        "flags": [*_FLAGS, *_LDFLAGS],
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def build_digest() -> str:
    blob = json.dumps(build_fingerprint(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def library_dir() -> Path:
    """Where this machine's library of this build is installed."""
    return cache_root() / "kernels" / build_digest()


def whole_library(directory: Path) -> Path | None:
    """The library file in `directory` when its record names this build and its bytes match the
    record's sha256; else None."""
    library = directory / LIBRARY_FILE
    try:
        record = json.loads((directory / RECORD_FILE).read_text())
        whole = record["digest"] == build_digest() and file_sha256(library) == record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return library if whole else None


def installed_library() -> Path | None:
    return whole_library(library_dir())


@contextlib.contextmanager
def install_lock() -> Iterator[None]:
    """Hold the flock that orders every build or install of this library on this machine (it
    dies with its process). While held, what killed builds left beside the directory is
    removed: their builders are gone."""
    directory = library_dir()
    with exclusive_lock(directory.with_name(f"{directory.name}.lock"), what="building kernels"):
        for path in remove_staging_leftovers(directory):
            logger.info("vllm-aot kernels: removed %s, left by an interrupted build", path)
        yield


def _build() -> None:
    """Build into a staging directory, record it, rename it into place (torch's builder also
    loads it into this process)."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    with staged_dir(library_dir()) as staging:
        built = cpp_extension.load(
            name=_LIBRARY,
            sources=[str(p) for p in _sources()],
            extra_cflags=list(_FLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(staging),
            is_python_module=False,
            verbose=False,
        )
        library = staging / LIBRARY_FILE
        if Path(built) != library:  # a second build in one process gets a versioned name
            os.rename(built, library)
        record = {
            "digest": build_digest(),
            "fingerprint": build_fingerprint(),
            "sha256": file_sha256(library),
            "bytes": library.stat().st_size,
            "built_on": socket.gethostname(),
            "created": time.time(),
        }
        write_json_atomic(staging / RECORD_FILE, record)
    logger.info(
        "vllm-aot kernels: built in %.1f s into %s", time.perf_counter() - start, library_dir()
    )


@functools.cache
def load() -> str:
    """Load the kernels library into this process (once), building it first when this machine
    has none installed. Returns "installed" (loaded from `library_dir()`) or "built" (built by
    this process, which loaded it)."""
    if installed_library() is None:
        with install_lock():
            if installed_library() is None:
                _build()
                return "built"
    library = library_dir() / LIBRARY_FILE
    torch.ops.load_library(str(library))
    logger.debug("vllm-aot kernels loaded from %s", library)
    return "installed"
