"""The engine's stats file: in this user's private runtime directory, files of processes gone
removed at start, and a broken or forged file never breaks `/metrics`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_aot.plugin.metrics import StatsCollector, new_stats_path

pytestmark = pytest.mark.unit


def test_the_stats_file_is_in_a_private_directory_of_the_user(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_AOT_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("VLLM_AOT_CACHE_DIR", str(tmp_path / "cache"))
    path = new_stats_path()
    assert path == tmp_path / "cache" / "run" / "stats" / f"stats-{os.getpid()}.json"
    assert not str(path).startswith(tempfile.gettempdir() + "/vllm-aot-stats")
    info = os.stat(path.parent)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()


def test_a_loose_runtime_directory_is_tightened_and_stale_files_are_removed(monkeypatch, tmp_path):
    directory = tmp_path / "run" / "stats"
    directory.mkdir(parents=True, mode=0o755)
    directory.chmod(0o755)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(gone.stdout)
    stale = directory / f"stats-{dead_pid}.json"
    stale.write_text("{}")
    staging = directory / f".{dead_pid + 1}-abcd1234.stats-{dead_pid}.json"
    staging.write_text("{")
    alive = directory / f"stats-{os.getppid()}.json"
    alive.write_text("{}")
    monkeypatch.setenv("VLLM_AOT_RUNTIME_DIR", str(tmp_path / "run"))
    path = new_stats_path()
    assert path.parent == directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert not stale.exists()
    assert not staging.exists()
    assert alive.exists()


def test_a_directory_of_another_kind_means_no_stats_not_a_failed_start(monkeypatch, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stats").write_text("not a directory")
    monkeypatch.setenv("VLLM_AOT_RUNTIME_DIR", str(tmp_path / "run"))
    assert new_stats_path() is None


MALFORMED = [
    b"[1, 2, 3]",
    b'"a string"',
    b"{not json",
    b"\xff\xfe",
    b"[" * 5000 + b"]" * 5000,
    json.dumps({"load": 5}).encode(),
    json.dumps({"load": {"hits": [], "misses": "many"}}).encode(),
    json.dumps({"load": {"configuration": {"dtype": 1}}}).encode(),
    json.dumps({"programs": [{"program": {"x": 1}, "kind": "decode", "executions": 1}]}).encode(),
    json.dumps({"programs": [7]}).encode(),
    json.dumps(
        {"steps": {"decode": {"padding_fraction": {"bounds": [1], "counts": [1, 2]}}}}
    ).encode(),
    json.dumps({"steps": {"prefill": "x"}, "seconds": {"host": "slow"}}).encode(),
]


@pytest.mark.parametrize("content", MALFORMED)
def test_a_malformed_stats_file_gives_zeros_not_a_broken_metrics(tmp_path, content):
    path = tmp_path / "stats.json"
    path.write_bytes(content)
    registry = CollectorRegistry()
    registry.register(StatsCollector(path))
    text = generate_latest(registry).decode()
    assert "vllm_aot:cache_misses_total 0.0" in text
    assert 'vllm_aot:step_seconds_total{part="host"} 0.0' in text
