"""AotWorker answers every method vLLM's engine and executors call on workers (read from
vLLM's source), or the feature that calls it is refused at start, or it is listed below as not
served; a method vLLM adds fails this test until it is decided here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import vllm
from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

from vllm_aot.plugin import platform
from vllm_aot.plugin.worker import AotWorker

pytestmark = pytest.mark.unit

VLLM = Path(vllm.__file__).parent
CALLERS = ("v1/engine", "v1/executor")  # the engine core, its clients, the executors

# Methods only features refused at start call -> the words of the refusal (plugin/platform.py).
REFUSED_AT_START = {
    "add_lora": "LoRA adapters",
    "remove_lora": "LoRA adapters",
    "pin_lora": "LoRA adapters",
    "list_loras": "LoRA adapters",
    "get_kv_connector_handshake_metadata": "--kv-transfer-config",
    "init_weight_transfer_engine": "--weight-transfer-config",
    "shutdown_weight_transfer_engine": "--weight-transfer-config",
    "start_weight_update": "--weight-transfer-config",
    "start_draft_weight_update": "--weight-transfer-config",
    "update_weights": "--weight-transfer-config",
    "finish_weight_update": "--weight-transfer-config",
    # Ray's elastic expert parallelism rescales vLLM's data parallel ranks.
    "adjust_rank": "vLLM's data parallelism",
    "elastic_ep_execute": "vLLM's data parallelism",
    "reinitialize_distributed": "vLLM's data parallelism",
}
# Methods of features that never start on our platform's engine from `vllm serve` flags; a
# call answers an error naming the method (HTTP 500 from a dev endpoint), the engine serves on.
NOT_SERVED = {
    "save_sharded_state": "LLM.save_sharded_state: the weights are compiled programs' inputs",
    "compute_weight_checksums": "/weight_checksums of vLLM's RL endpoints (weight updates)",
    "checkpoint_prepare": "vLLM's process snapshots (CRIU)",
    "checkpoint_restore": "vLLM's process snapshots (CRIU)",
}


def called_on_workers() -> dict[str, str]:
    """Method name -> the vLLM file that calls it through `collective_rpc("name", ...)`."""
    called: dict[str, str] = {}
    for folder in CALLERS:
        for path in sorted((VLLM / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "collective_rpc"
                    and node.args
                ):
                    continue
                method = node.args[0]
                if isinstance(method, ast.Constant) and isinstance(method.value, str):
                    called.setdefault(method.value, str(path.relative_to(VLLM)))
    return called


def is_answered(name: str) -> bool:
    """AotWorker (or vLLM's wrapper around every worker) defines it, other than as WorkerBase's
    NotImplementedError placeholder."""
    if name in vars(WorkerWrapperBase):
        return True
    for cls in AotWorker.__mro__:
        if name in vars(cls):
            if cls is not WorkerBase:
                return True
            return "raise NotImplementedError" not in inspect.getsource(vars(cls)[name])
    return False


def test_vllms_callers_are_found():
    called = called_on_workers()
    assert {"execute_model", "sleep", "reset_encoder_cache", "update_max_model_len"} <= set(called)


def test_every_method_vllm_calls_on_workers_is_answered():
    missing = {
        name: where
        for name, where in called_on_workers().items()
        if name not in REFUSED_AT_START and name not in NOT_SERVED and not is_answered(name)
    }
    assert not missing, f"AotWorker lacks methods vLLM calls: {missing}"


def test_methods_of_refused_features_are_refused_at_start():
    refusals = inspect.getsource(platform._refuse_unsupported)
    for name, words in REFUSED_AT_START.items():
        assert words in refusals, f"{name}: no refusal naming {words!r}"


def test_the_lists_name_only_methods_vllm_calls():
    """A list entry vLLM no longer calls, or AotWorker now answers, goes."""
    called = called_on_workers()
    for name in (*REFUSED_AT_START, *NOT_SERVED):
        assert name in called, f"{name}: vLLM no longer calls it"
    for name in NOT_SERVED:
        assert not is_answered(name), f"{name}: answered now, take it off NOT_SERVED"
