"""The shape of the code, as docs/architecture.md promises it: layers that import only downward,
vLLM's types only in plugin/, and files and functions small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_aot"
# Each package may import only the packages after it in this list (top-level modules are leaves).
LAYERS = ("cli", "serve", "accuracy", "plugin", "loading", "cache", "runtime", "kernels", "models")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0]


@pytest.mark.parametrize("path", _sources(PACKAGE), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_down_the_layers(path):
    own = _layer(path)
    if own not in LAYERS:
        return  # vllm_aot/*.py: leaves (paths, files, processes, testing) and the entry point
    below = set(LAYERS[LAYERS.index(own) + 1 :])
    for name in _imports(path):
        parts = name.split(".")
        if parts[0] == "vllm":
            assert own == "plugin", f"{path.name} imports {name}: only plugin/ knows vLLM"
        if parts[0] == "vllm_aot" and len(parts) > 1 and parts[1] in LAYERS:
            assert parts[1] == own or parts[1] in below, (
                f"{own}/{path.name} imports {name}: {own} may import only {sorted(below)}"
            )


def test_files_and_functions_stay_readable():
    too_long = []
    for path in _sources(PACKAGE, ROOT / "tests", ROOT / "bench"):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function"
