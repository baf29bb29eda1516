"""plugin/front_end.py: the front end's threads at a lower priority, the step's kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_aot.plugin.front_end import IDLE, front_end_nice

pytestmark = pytest.mark.unit


def test_front_end_nice_reads_0_to_19_or_idle_and_names_the_range_otherwise():
    assert front_end_nice({}) == 0
    assert front_end_nice({"VLLM_AOT_FRONT_END_NICE": " 19 "}) == 19
    assert front_end_nice({"VLLM_AOT_FRONT_END_NICE": "idle"}) == IDLE
    for bad in ("20", "-1", "high"):
        with pytest.raises(ValueError, match=r"VLLM_AOT_FRONT_END_NICE.*from 0 to 19, or idle"):
            front_end_nice({"VLLM_AOT_FRONT_END_NICE": bad})


# A child process named as vLLM's engine, `pid`, alive for two seconds (scripts format it in).
FORK_ENGINE = """pid = os.fork()
if pid == 0:
    open("/proc/self/comm", "w").write("VLLM::EngineCore")
    time.sleep(2)
    os._exit(0)
"""


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


def test_the_api_server_lowers_itself_and_moves_to_its_cores_once_the_engine_has_forked():
    out = run(
        f"""
import os, time
from vllm_aot.plugin.front_end import lower_after_engine_forks, plan_front_end
cores = sorted(os.sched_getaffinity(0))
plan_front_end(cores[-1:], is_async=True)  # what the platform decides for the engine
watcher = lower_after_engine_forks(7, poll_seconds=0.05)
time.sleep(0.3)
def state(pid): return os.getpriority(os.PRIO_PROCESS, pid), sorted(os.sched_getaffinity(pid))
before = state(0)
{FORK_ENGINE}watcher.join(10)
print(before == (0, cores), state(0) == (7, cores[-1:]), state(pid) == (0, cores))
os.waitpid(pid, 0)
"""
    )
    assert out == "True True True"


def test_idle_puts_the_lowered_threads_at_sched_idle_and_keeps_the_kept_one():
    out = run(
        """
import os, threading
from vllm_aot.plugin.front_end import IDLE, lower_python_threads
stop = threading.Event(); ids = {}
def wait(): ids[threading.current_thread().name] = threading.get_native_id(); stop.wait()
step = threading.Thread(target=wait, name="step"); step.start()
while len(ids) < 1: pass
lower_python_threads(IDLE, keep=(ids["step"],))
late = threading.Thread(target=wait, name="late"); late.start()
while len(ids) < 2: pass
def policy(tid): return os.sched_getscheduler(tid) == os.SCHED_IDLE
def nice(tid): return os.getpriority(os.PRIO_PROCESS, tid)
print(policy(ids["step"]), nice(ids["step"]), policy(threading.get_native_id()),
      nice(threading.get_native_id()), policy(ids["late"]))
stop.set()
"""
    )
    assert out == "False 0 True 19 True"


def test_under_synchronous_scheduling_idle_lowers_the_api_server_to_nice_19_only():
    out = run(
        f"""
import os, time
from vllm_aot.plugin.front_end import IDLE, lower_after_engine_forks, plan_front_end
plan_front_end((), is_async=False)  # pooling, speculative decoding
watcher = lower_after_engine_forks(IDLE, poll_seconds=0.05)
{FORK_ENGINE}watcher.join(10)
print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) == os.SCHED_IDLE)
os.waitpid(pid, 0)
"""
    )
    assert out == "19 False"
