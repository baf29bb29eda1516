"""llama.cpp as a peer in bench/perf_bench.py: its build, its server command and its quirks.

`scripts/setup_llamacpp.sh` builds llama.cpp once into `.venv-llamacpp/` for two servers:

- `native`: llama.cpp's own `llama-server` (parallel slots, continuous batching), preferred;
- `python`: llama-cpp-python's OpenAI server (one request at a time) on the same libraries, the
  fallback, started through `llamacpp_python_server.py` under that venv's interpreter.

Both serve the bundled GGUF itself (our servers and vLLM's serve it dequantised). Quirks of the
servers under `vllm bench serve` (docs/benchmarking.md), and what is done about each:

- no token count `vllm bench serve` reads: llama-cpp-python streams no usage, and llama-server
  sends it in the last chunk beside `choices`, where the client does not look. The client then
  re-tokenises the text, which undercounts sampled text, so `perf_bench` counts each completed
  request at its max_tokens (every request runs to it: the two points below);
- llama-cpp-python ignores `ignore_eos`: the end-of-text tokens are banned with `logit_bias`
  (llama-server honours `ignore_eos`);
- llama-cpp-python answers a non-UUID `X-Request-ID` (which `vllm bench serve` always sends,
  with no flag to turn it off) with HTTP 400: `llamacpp_python_server.py` drops that header;
- llama-server closes kept-alive connections: requests carry `Connection: close`, so the client
  opens a fresh connection for each rather than reusing one the server may have closed;
- llama-server reuses a slot's cached prompt: `perf_bench` gives every run its own seed, so no
  run repeats an earlier run's prompts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BUILD_DIR = Path(__file__).resolve().parents[1] / ".venv-llamacpp"
LIB_DIR = BUILD_DIR / "build" / "llama.cpp" / "bin"  # llama-server and the shared libraries
PYTHON_SERVER = Path(__file__).with_name("llamacpp_python_server.py")
KINDS = ("native", "python")
_MAX_MODEL_LEN = 2048  # per slot, as vLLM's and ours


@dataclass(frozen=True)
class LlamaCppServer:
    """One built llama.cpp server: how to start it, check it is up and drive it."""

    kind: str  # one of KINDS

    @property
    def label(self) -> str:
        return "llama-server (native)" if self.kind == "native" else "llama-cpp-python server"

    @property
    def env(self) -> dict[str, str]:
        return {} if self.kind == "native" else {"LLAMA_CPP_LIB_PATH": str(LIB_DIR)}

    @property
    def health_path(self) -> str:
        return "/health" if self.kind == "native" else "/v1/models"

    def command(self, gguf: Path, port: int, *, name: str, num_slots: int) -> list[str]:
        num_threads = len(os.sched_getaffinity(0))
        if self.kind == "native":
            return [
                str(LIB_DIR / "llama-server"), "--model", str(gguf), "--alias", name,
                "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(num_threads), "--threads-batch", str(num_threads),
                "--parallel", str(num_slots), "--ctx-size", str(num_slots * _MAX_MODEL_LEN),
                *(["--no-repack"] if _advertises_amx() else []),
            ]  # fmt: skip
        return [
            str(BUILD_DIR / "bin" / "python"), str(PYTHON_SERVER), str(gguf), "--alias", name,
            "--port", str(port), "--threads", str(num_threads), "--ctx-size", str(_MAX_MODEL_LEN),
        ]  # fmt: skip

    def bench_args(self, banned_ids: Iterable[int]) -> list[str]:
        """`vllm bench serve` flags for this server's quirks (`banned_ids`: its end-of-text)."""
        if self.kind == "native":
            return ["--header", "Connection=close"]
        banned = {str(token): -100 for token in banned_ids}
        return ["--extra-body", json.dumps({"logit_bias": banned})]


def _advertises_amx() -> bool:
    """Whether the CPU says it has AMX. ggml's AMX kernels (an "extra buffer type", on by
    default) then die of SIGILL at their first tile instruction on the VMs these benchmarks run
    on, although oneDNN's AMX matmuls run there. `--no-repack` turns ggml's extra buffer types
    off: llama.cpp keeps its AVX-512 VNNI kernels, and on x86 neither Q4_1 nor Q8_0 (the bundled
    model's formats) has a repacked layout it would lose."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def find_server(kind: str | None = None) -> LlamaCppServer | None:
    """The built server of `kind`, or by default the native one if built, else the Python one."""
    built = {
        "native": (LIB_DIR / "llama-server").is_file(),
        "python": (LIB_DIR / "libllama.so").is_file()
        and any(BUILD_DIR.glob("lib/python*/site-packages/llama_cpp/server")),
    }
    for candidate in (kind,) if kind else KINDS:
        if built[candidate]:
            return LlamaCppServer(candidate)
    return None


def gguf_file_type(gguf: Path) -> str:
    """The GGUF's quantisation as llama.cpp names it (`MOSTLY_Q4_1` → `Q4_1`)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(gguf).fields["general.file_type"]
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


def gguf_decode_bytes(gguf: Path) -> int:
    """Weight bytes one decode step reads: every tensor, but of an embedding table that is not
    also the output layer (untied) only a row a token, left out."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())
