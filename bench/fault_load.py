"""Faults under load: `vllm-aot serve --data-parallel-size 2` with 16 keyed streams throughout.

Serves the tiny random model (eager, an API key, a soft open-file limit of 1024); while 16
streaming /v1/completions clients run, injects one after the other: a) 1,100 idle connections
sending half a request header (from 5 loopback addresses); b) OPTIONS /metrics without a key
and a CORS preflight; c) no key / a wrong key on several routes; d) SIGKILL of replica 0's
engine (it restarts; pooled connections to it go stale); e) a replica's port without the
replica key. Prints per fault the streams' requests completed and failed (those on the killed
replica in d, in flight or sent before its ejection, counted apart) and what the attacker
got; then SIGTERM, and no process of serve's tree nor file of theirs (/dev/shm, /tmp, their
TMPDIR and runtime directory) may be left. Exits 1 on any loss. Not a test: ~5 min on 2 cores.

    .venv/bin/python bench/fault_load.py [--streams 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from vllm_aot.models.prepare import prepare_default_model
from vllm_aot.models.tiny import make_tiny_model
from vllm_aot.testing import free_port, wait_healthy

API_KEY = "load-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SHAPES = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "64", "--dtype", "float32"]  # fmt: skip
ATTACK_ADDRESSES = [f"127.0.0.{i}" for i in range(2, 7)]
KEYED_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                ("POST", "/invocations"), ("GET", "/metrics"), ("POST", "/start_profile"),
                ("POST", "/pooling"), ("POST", "/score")]  # fmt: skip


@dataclass
class Outcome:
    phase: str
    replica: str | None
    ok: bool
    error: str = ""
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Run:
    url: str
    phase: str = "warm-up"
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)
    attacker: dict[str, str] = field(default_factory=dict)


def stream_loop(run: Run, max_tokens: int) -> None:
    """One legitimate client: keyed streaming completions, one after the other, until stopped."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    with httpx.Client(timeout=120) as client:
        while not run.stop.is_set():
            outcome = Outcome(run.phase, None, False, started=time.monotonic())
            try:
                with client.stream(
                    "POST", f"{run.url}/v1/completions", json=body, headers=AUTH
                ) as response:
                    outcome.replica = response.headers.get("x-vllm-aot-replica")
                    if response.status_code != 200:
                        outcome.error = f"HTTP {response.status_code} {response.read()[:120]!r}"
                    else:
                        last = ""
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                last = line.removeprefix("data: ")
                        outcome.ok = last == "[DONE]"
                        outcome.error = "" if outcome.ok else f"stream ended: {last[:160]}"
            except httpx.HTTPError as exc:
                outcome.error = f"transport: {exc!r}"[:200]
            outcome.ended = time.monotonic()
            run.outcomes.append(outcome)


def half_header_connections(port: int, count: int) -> list[socket.socket]:
    """`count` connections from the attack addresses, each sending half a request header."""
    sockets = []
    for i in range(count):
        sock = socket.socket()
        sock.bind((ATTACK_ADDRESSES[i % len(ATTACK_ADDRESSES)], 0))
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            sock.close()
            continue
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket) -> bool:
    try:
        sock.recv(4096)  # an answer (503) or EOF: the server let it go
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def fault_idle_connections(run: Run, port: int) -> None:
    t0 = time.monotonic()
    sockets = half_header_connections(port, 1100)
    opened = time.monotonic() - t0
    keyed = httpx.get(f"{run.url}/v1/models", headers=AUTH, timeout=30).status_code
    time.sleep(2)
    early = sum(closed_by_server(s) for s in sockets)
    deadline = time.monotonic() + 15  # header timeout 10 s
    while time.monotonic() < deadline and not all(closed_by_server(s) for s in sockets):
        time.sleep(0.5)
    left = sum(not closed_by_server(s) for s in sockets)
    for sock in sockets:
        sock.close()
    after = httpx.get(f"{run.url}/v1/models", headers=AUTH, timeout=30).status_code
    run.attacker["a"] = (
        f"{len(sockets)} opened in {opened:.1f} s; {early} let go within 2 s (cap), "
        f"{len(sockets) - left} within {time.monotonic() - t0:.0f} s, {left} still open; "
        f"keyed request during {keyed}, after {after}"
    )


def fault_options(run: Run) -> None:
    metrics = httpx.options(f"{run.url}/metrics", timeout=30)
    cors = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST"}
    preflight = httpx.options(f"{run.url}/v1/completions", headers=cors, timeout=30)
    leaked = "vllm:" in metrics.text
    run.attacker["b"] = (
        f"OPTIONS /metrics {metrics.status_code}{' WITH SERIES' if leaked else ''}; preflight "
        f"{preflight.status_code} {preflight.text[:40]!r} allow-origin "
        f"{preflight.headers.get('access-control-allow-origin')}"
    )
    run.attacker["b_bad"] = str(metrics.status_code != 401 or leaked)


def fault_bad_keys(run: Run) -> None:
    got: Counter = Counter()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in KEYED_ROUTES:
            body = {"model": "tiny", "prompt": "hi"} if method == "POST" else None
            response = httpx.request(method, f"{run.url}{path}", json=body, headers=headers,
                                     timeout=30)  # fmt: skip
            got[response.status_code] += 1
    run.attacker["c"] = ", ".join(f"{n}x {status}" for status, n in sorted(got.items()))
    run.attacker["c_bad"] = str(set(got) != {401})


def replica_pid_and_port(log: Path, index: int) -> tuple[int, int]:
    found = re.findall(rf"replica {index} \(pid (\d+)\) on .*:(\d+)$", log.read_text(), re.M)
    pid, port = found[-1]
    return int(pid), int(port)


def replica_states(url: str) -> list[bool]:
    return [r["healthy"] for r in httpx.get(f"{url}/health", timeout=30).json()["replicas"]]


def wait_for(condition, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if condition():
                return time.monotonic() - t0
        time.sleep(0.2)
    raise TimeoutError(what)


def fault_kill_engine(run: Run, log: Path) -> tuple[float, float]:
    """SIGKILL replica 0's engine; (kill time, time /health first showed it ejected)."""
    pid, _ = replica_pid_and_port(log, 0)
    engines = psutil.Process(pid).children(recursive=True)
    victim = engines[0] if engines else psutil.Process(pid)
    name = victim.name()
    killed_at = time.monotonic()
    victim.kill()
    ejected = wait_for(lambda: not replica_states(run.url)[0], 60, "replica 0 ejected")
    ejected_at = time.monotonic()
    back = wait_for(lambda: all(replica_states(run.url)), 240, "replica 0 re-admitted")
    run.attacker["d"] = (
        f"killed {name} (pid {victim.pid}); ejected after {ejected:.1f} s, "
        f"re-admitted {back:.0f} s later"
    )
    return killed_at, ejected_at


def fault_direct_replica(run: Run, log: Path) -> None:
    _, port = replica_pid_and_port(log, 1)
    got = []
    for headers in ({}, AUTH):
        for path in ("/health", "/v1/models", "/metrics"):
            got.append(httpx.get(f"http://127.0.0.1:{port}{path}", headers=headers,
                                 timeout=30).status_code)  # fmt: skip
    run.attacker["e"] = f"replica port {port}: {got}"
    run.attacker["e_bad"] = str(set(got) != {401})


class TreeWatcher:
    """Every process of serve's tree, and the /dev/shm and /tmp files they map or hold."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.processes: dict[int, psutil.Process] = {pid: self.root}
        self.files: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.look()

    def look(self) -> None:
        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        for process in children:
            self.processes.setdefault(process.pid, process)
            try:
                paths = [m.path for m in process.memory_maps()]
                paths += [f.path for f in process.open_files()]
            except (psutil.Error, OSError):
                continue
            self.files |= {p for p in paths if p.startswith(("/dev/shm/", "/tmp/"))}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def left(self) -> list[str]:
        alive = []
        for process in self.processes.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{process.pid} {process.name()}")
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            except psutil.AccessDenied:
                alive.append(f"{process.pid} (access denied)")
        return alive


def is_targeted(o: Outcome, kill_window: tuple[float, float] | None) -> bool:
    """A request the kill targets: on replica 0, in flight at the kill or sent to it before the
    proxy's /health showed it ejected (a second's margin for the health check's interval)."""
    if kill_window is None or o.ok or o.replica not in ("0", None):
        return False
    killed_at, ejected_at = kill_window
    return o.ended >= killed_at and o.started <= ejected_at + 1.0


def summarize(run: Run, phases: list[tuple[str, str]], kill_window) -> tuple[list, int]:
    rows, losses = [], 0
    for key, label in phases:
        outcomes = [o for o in run.outcomes if o.phase == key]
        targeted = [o for o in outcomes if key == "d" and is_targeted(o, kill_window)]
        failed = [o for o in outcomes if not o.ok and o not in targeted]
        losses += len(failed) + (run.attacker.get(f"{key}_bad") == "True")
        rows.append((label, sum(o.ok for o in outcomes), len(failed), len(targeted),
                     run.attacker.get(key, "")))  # fmt: skip
        for o in failed[:5]:
            print(f"  [{key}] failed on replica {o.replica}: {o.error}")
    return rows, losses


PHASES = [("a", "a) 1,100 idle half-header connections"), ("b", "b) OPTIONS /metrics, preflight"),
          ("c", "c) no key / wrong key, 8 routes"), ("d", "d) SIGKILL replica 0's engine"),
          ("e", "e) replica port without replica key"), ("tail", "after the faults")]  # fmt: skip


def start_serve(work: Path, port: int) -> subprocess.Popen:
    """serve DP=2 under a soft open-file limit of 1024, its temporary and runtime directories
    under `work` (tmp/, run/), its log in work/serve.log."""
    model = make_tiny_model(work / "tiny", tokenizer_dir=prepare_default_model())
    command = [sys.executable, "-m", "vllm_aot.cli.main", "serve", str(model), "--backend",
               "eager", "--port", str(port), *SHAPES, "--data-parallel-size", "2",
               "--api-key", API_KEY, "--proxy-health-interval", "0.5",
               "--replica-log-dir", str(work)]  # fmt: skip
    (work / "tmp").mkdir()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(work / "tmp"),
           "VLLM_AOT_RUNTIME_DIR": str(work / "run"),
           "VLLM_AOT_COMPILE_CACHE": str(work / "compiled")}  # fmt: skip
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low_nofile = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    with open(work / "serve.log", "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=low_nofile)  # fmt: skip


def inject_faults(run: Run, port: int, log: Path, streams: list[threading.Thread]):
    """Start the streams, inject the faults one after the other; the kill's window."""
    for thread in streams:
        thread.start()
    time.sleep(5)
    kill_window = None
    for key, inject in [("a", lambda: fault_idle_connections(run, port)),
                        ("b", lambda: fault_options(run)),
                        ("c", lambda: fault_bad_keys(run)),
                        ("d", lambda: fault_kill_engine(run, log)),
                        ("e", lambda: fault_direct_replica(run, log))]:  # fmt: skip
        run.phase = key
        print(f"fault {key} ...", flush=True)
        result = inject()
        kill_window = result if key == "d" else kill_window
        time.sleep(5)  # the streams run on past the fault
    run.phase = "tail"
    time.sleep(5)
    return kill_window


def stop_serve(process: subprocess.Popen) -> int | str:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return "hung (killed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's 1,100 sockets
    work = Path(tempfile.mkdtemp(prefix="fault-load-"))
    port = free_port()
    t_start = time.monotonic()
    process = start_serve(work, port)
    watcher = TreeWatcher(process.pid)
    run = Run(f"http://127.0.0.1:{port}")
    streams = [threading.Thread(target=stream_loop, args=(run, args.max_tokens), daemon=True)
               for _ in range(args.streams)]  # fmt: skip
    kill_window = None
    try:
        wait_healthy(run.url, process, timeout=300)
        wait_for(lambda: all(replica_states(run.url)), 120, "both replicas healthy")
        print(f"serve up in {time.monotonic() - t_start:.0f} s (pid {process.pid})", flush=True)
        kill_window = inject_faults(run, port, work / "serve.log", streams)
    except Exception as exc:  # report what was measured, then stop everything
        print(f"run aborted: {exc!r}", flush=True)
        run.attacker["abort"] = repr(exc)
    finally:
        run.stop.set()
        for thread in streams:
            if thread.is_alive():
                thread.join(120)
        watcher.look()
        watcher.close()
        code = stop_serve(process)
    time.sleep(1)
    left = watcher.left()
    files = sorted(p for p in watcher.files if os.path.exists(p) and not p.startswith(f"{work}/"))
    files += [str(p) for p in (work / "tmp").rglob("*")]
    files += [str(p) for p in (work / "run").rglob("*") if p.is_file()]

    rows, losses = summarize(run, PHASES, kill_window)
    print(f"\nvllm-aot serve --data-parallel-size 2, {args.streams} streams of "
          f"{args.max_tokens} tokens, {time.monotonic() - t_start:.0f} s wall\n")  # fmt: skip
    print(
        "| fault | streams completed | streams failed | targeted (killed replica) | attacker got |"
    )
    print("|---|---|---|---|---|")
    for label, done, failed, targeted, got in rows:
        print(f"| {label} | {done} | {failed} | {targeted} | {got} |")
    print(f"| SIGTERM | exit {code} | | | {len(watcher.processes)} processes seen, "
          f"{len(left)} left {left}; files left {files or 0} |")  # fmt: skip
    losses += len(left) + len(files) + (code != 0) + ("abort" in run.attacker)
    print(f"\n{'OK' if losses == 0 else f'LOSSES: {losses}'}; logs in {work}")
    return 1 if losses else 0


if __name__ == "__main__":
    sys.exit(main())
