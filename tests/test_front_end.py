"""plugin/front_end.py: the front end's threads at a lower priority, the step's kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_aot.plugin.front_end import front_end_nice


def test_front_end_nice_reads_0_to_19_and_names_the_range_otherwise():
    assert front_end_nice({}) == 0
    assert front_end_nice({"VLLM_AOT_FRONT_END_NICE": " 19 "}) == 19
    for bad in ("20", "-1", "high"):
        with pytest.raises(ValueError, match=r"VLLM_AOT_FRONT_END_NICE.*from 0 to 19"):
            front_end_nice({"VLLM_AOT_FRONT_END_NICE": bad})


def run(script: str) -> str:
    """`script` in a fresh interpreter (priorities only go up: not in the test process)."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


def test_every_python_thread_but_the_kept_one_is_lowered_and_new_ones_inherit():
    out = run(
        """
import os, threading
from vllm_aot.plugin.front_end import lower_python_threads
def nice(tid): return os.getpriority(os.PRIO_PROCESS, tid)
stop = threading.Event(); ids = {}
def wait(): ids[threading.current_thread().name] = threading.get_native_id(); stop.wait()
step = threading.Thread(target=wait, name="step"); step.start()
other = threading.Thread(target=wait, name="other"); other.start()
while len(ids) < 2: pass
lowered = lower_python_threads(12, keep=(ids["step"],))
late = threading.Thread(target=wait, name="late"); late.start()
while len(ids) < 3: pass
print(nice(ids["step"]), nice(ids["other"]), nice(threading.get_native_id()), nice(ids["late"]),
      ids["step"] in lowered)
stop.set()
"""
    )
    assert out == "0 12 12 12 False"


def test_the_api_server_lowers_itself_only_once_the_engine_has_forked():
    out = run(
        """
import os, time
from vllm_aot.plugin.front_end import lower_after_engine_forks
watcher = lower_after_engine_forks(7, poll_seconds=0.05)
time.sleep(0.3)
before = os.getpriority(os.PRIO_PROCESS, 0)
pid = os.fork()
if pid == 0:
    open("/proc/self/comm", "w").write("VLLM::EngineCore")
    time.sleep(2)
    os._exit(0)
watcher.join(10)
print(before, os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, pid))
os.waitpid(pid, 0)
"""
    )
    assert out == "0 7 0"
