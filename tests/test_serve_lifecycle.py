"""`vllm-aot serve`'s proxy and replica manager as processes, over fake replicas (no vLLM):
SIGTERM with streams in flight, a crashed replica reaped without stalling the proxy, a hung
replica killed and restarted, a restart that never becomes healthy. Nothing is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import children_of, cmdline_of, is_gone, wait_until
from vllm_aot.plugin.server_guard import REPLICA_KEY_ENV, REPLICA_KEY_HEADER
from vllm_aot.testing import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    """A `serve_replicas` process over fake replicas, and everything it ever started."""

    url: str
    process: subprocess.Popen
    log: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def descendants(self) -> list[psutil.Process]:
        found = children_of(self.process.pid)
        self.seen.update({p.pid: p for p in found})
        return found

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def replica_port(self, index: int) -> str:
        """Replica `index`'s port, from serve's log (its /health names no address)."""
        starts = re.findall(
            rf"replica {index} \(pid \d+\) on .*:(\d+)$", self.log.read_text(), re.M
        )
        return starts[-1]

    def replica_process(self, index: int) -> psutil.Process:
        port = self.replica_port(index)
        return next(p for p in self.descendants() if port in cmdline_of(p))

    def all_gone(self) -> bool:
        return all(is_gone(p) for p in self.seen.values())

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM serve (everything it started noted first); it must exit with code 0 within
        `timeout` s."""
        self.descendants()
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout) == 0


@contextlib.contextmanager
def fake_serve(tmp_path: Path, **config):
    config = {"port": free_port(), **config}
    (tmp_path / "serve.json").write_text(json.dumps(config))
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.serve_fakes", "serve", str(tmp_path / "serve.json")],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    served = Served(f"http://127.0.0.1:{config['port']}", process, log)
    try:
        wait_healthy(served.url, process, timeout=60)
        wait_until(lambda: len(served.descendants()) >= 2, 60, "both replicas up")
        yield served
    finally:
        served.descendants()
        process.kill()
        process.wait()
        for leftover in served.seen.values():  # only when a test failed midway
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()


def stream_events(url: str, payloads: list[str], started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/stream", timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line.removeprefix("data: "))
                    started.set()
    except httpx.HTTPError as exc:
        payloads.append(f"transport error: {exc!r}")


@pytest.mark.parametrize("on_sigterm", ["exit", "ignore"])
def test_sigterm_with_16_streams_in_flight_stops_within_the_grace(tmp_path, on_sigterm):
    grace = 3.0
    replica_args = ["--on-sigterm", on_sigterm, "--engine"]
    with fake_serve(tmp_path, replica_args=replica_args, stop_grace=grace) as served:
        wait_until(lambda: len(served.descendants()) == 4, 60, "two replicas and their engines")
        streams = [([], threading.Event()) for _ in range(16)]
        threads = [
            threading.Thread(target=stream_events, args=(served.url, payloads, started))
            for payloads, started in streams
        ]
        for thread in threads:
            thread.start()
        for _, started in streams:
            assert started.wait(30), "a stream got no first event"
        # The streams are endless and the engines ignore SIGTERM: only the kill at the end of
        # the grace lets serve exit.
        served.stop(timeout=60)
        for thread in threads:
            thread.join(30)
        assert served.all_gone(), "a replica or engine outlived serve"
        for payloads, _ in streams:  # every stream told in-band that it was cut short
            assert '"error"' in payloads[-1] and "shutting down" in payloads[-1], payloads[-1]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{served.url}/health", timeout=5)
        assert "all replicas stopped" in served.log.read_text()


def test_reaping_a_crashed_replica_does_not_stall_the_proxy(tmp_path):
    with fake_serve(tmp_path, replica_args=["--engine"]) as served:
        victim = served.replica_process(1)
        # Its engine ignores SIGTERM: reaping it takes the orphan grace.
        (engine,) = wait_until(lambda: children_of(victim.pid), 60, "replica 1's engine")
        victim.kill()

        def answered_while_reaping() -> bool:
            """/health answers, reporting replica 1's exit noticed while its engine still runs:
            the proxy serves while the manager waits out the orphan grace."""
            response = httpx.get(f"{served.url}/health", timeout=30)
            assert response.status_code == 200
            return not response.json()["replicas"][1]["started"] and not is_gone(engine)

        wait_until(answered_while_reaping, 60, "/health answered during the reaping")
        wait_until(lambda: is_gone(engine), 30, "the orphaned engine killed")
        wait_until(lambda: served.health()["replicas"][1]["healthy"], 60, "replica 1 restarted")
        assert served.replica_process(1).pid != victim.pid
        assert "replica 1 process exited with code -9; restarting in 1 s" in served.log.read_text()


@dataclass
class Load:
    """Worker threads sending small requests until stopped: (time, status, replica) each."""

    url: str
    num_workers: int = 4
    results: list[tuple[float, int, str | None]] = field(default_factory=list)
    is_stopped: threading.Event = field(default_factory=threading.Event)

    def work(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.is_stopped.is_set():
                response = client.post("/v1/echo", content=b"x")
                replica = response.headers.get("x-vllm-aot-replica")
                self.results.append((time.monotonic(), response.status_code, replica))

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self.work) for _ in range(self.num_workers)]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.is_stopped.set()
        for thread in self.threads:
            thread.join(30)

    def served_by(self, replica: str, after: float) -> int:
        return sum(1 for t, s, r in self.results if r == replica and s == 200 and t > after)


def test_a_hung_replica_under_load_is_killed_and_restarted(tmp_path):
    policy = {"hang_timeout": 2.0}
    with fake_serve(tmp_path, replica_args=["--engine"], policy=policy) as served:
        victim = served.replica_process(1)
        (engine,) = wait_until(lambda: children_of(victim.pid), 60, "replica 1's engine")
        with Load(served.url) as load:
            wait_until(lambda: load.served_by("1", 0) > 10, 60, "load on both replicas")
            victim.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_until(lambda: is_gone(victim), 60, "the hung replica killed")
            killed_at = time.monotonic()
            wait_until(lambda: is_gone(engine), 30, "its engine killed")
            wait_until(lambda: load.served_by("1", killed_at) > 10, 60, "replica 1 back in service")
        # Replica 0 served throughout; only the requests stuck on the hung replica failed.
        assert load.served_by("0", stopped_at + 1.0) > 10
        failed = [(s, r) for t, s, r in load.results if s != 200]
        assert len(failed) <= load.num_workers
        assert all(s == 502 for s, _ in failed), failed
        text = served.log.read_text()
        assert f"replica 1 (pid {victim.pid}) failed every health check" in text
        assert "replica 1 killed after it failed every health check" in text
        assert "restarting in 1 s" in text
        served.stop()
        assert served.all_gone()


def test_a_restart_that_never_becomes_healthy_is_killed_then_left_down(tmp_path):
    policy = {"start_timeout": 5.0, "max_restarts": 1}
    sick_files = str(tmp_path / "sick-{port}")
    with fake_serve(tmp_path, replica_args=["--sick-file", sick_files], policy=policy) as served:
        port = served.replica_port(1)
        Path(sick_files.format(port=port)).touch()  # replica 1's next process answers 503
        served.replica_process(1).kill()
        wait_until(lambda: "leaving it down" in served.log.read_text(), 60, "replica 1 given up")
        text = served.log.read_text()
        assert "did not pass a health check since its start for 5 s; killing it" in text
        assert "killed after it did not pass a health check" in text
        assert "1 restarts failed, leaving it down" in text
        report = served.health()  # replica 0 serves on
        assert report["status"] == "ok" and not report["replicas"][1]["healthy"]
        assert "leaving it down" in report["replicas"][1]["problem"]
        served.stop()
        assert served.all_gone()


def test_replicas_require_the_launch_key_and_carry_no_client_key(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "user-env-key")
    client_key = ["--api-key", "client-key"]
    with fake_serve(tmp_path, api_keys=["client-key"], replica_args=client_key) as served:
        wait_until(lambda: served.health()["status"] == "ok", 60, "both replicas healthy")
        keys = set()
        for index in (0, 1):
            process = served.replica_process(index)
            assert "client-key" not in process.cmdline()  # `ps` shows nothing to other users
            env = process.environ()
            assert "VLLM_API_KEY" not in env
            keys.add(env[REPLICA_KEY_ENV])
            direct = f"http://127.0.0.1:{served.replica_port(index)}"
            for path in ("/health", "/tokenize"):  # a local user reaches no replica directly
                assert httpx.get(f"{direct}{path}", timeout=10).status_code == 401
            headers = {REPLICA_KEY_HEADER: env[REPLICA_KEY_ENV]}
            assert httpx.get(f"{direct}/health", headers=headers, timeout=10).status_code == 200
        assert len(keys) == 1 and len(keys.pop()) >= 32
        assert httpx.get(f"{served.url}/tokenize", timeout=10).status_code == 401
        headers = {"Authorization": "Bearer client-key"}
        assert httpx.get(f"{served.url}/tokenize", headers=headers, timeout=10).status_code == 200
        report = json.dumps(served.health())
        assert served.replica_port(0) not in report and "127.0.0.1" not in report
        served.stop()
        assert served.all_gone()
