"""What start-up promises a person: stale programs are never served after a code change, and a
compile shows one readable progress line."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

import vllm_aot
from vllm_aot.cache.keys import source_digest
from vllm_aot.loading.progress import CompileProgress

pytestmark = pytest.mark.unit

GENERATOR = "vllm_aot.runtime.compiler"


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "vllm_aot"
    shutil.copytree(
        Path(vllm_aot.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__")
    )
    return copy


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_a_code_change_in_any_generating_module_changes_every_program_key(tmp_path):
    package = _copy_package(tmp_path)
    base = source_digest(package, GENERATOR)
    # layers.py is reached only through programs.py's imports: the digest follows them.
    _edit(package / "models" / "layers.py", "xf.pow(2)", "xf.pow(2.0)")
    assert source_digest(package, GENERATOR) != base
    package = _copy_package(tmp_path / "again")
    (package / "kernels" / "avx2.h").write_text((package / "kernels" / "avx2.h").read_text() + " ")
    assert source_digest(package, GENERATOR) != base


def test_comments_docstrings_and_unrelated_modules_keep_the_keys(tmp_path):
    package = _copy_package(tmp_path)
    base = source_digest(package, GENERATOR)
    programs = package / "runtime" / "programs.py"
    programs.write_text("# a comment\n" + programs.read_text())
    _edit(programs, '"""', '"""Reworded. ')
    (package / "serve" / "proxy.py").write_text("")  # serving code generates no program
    assert source_digest(package, GENERATOR) == base


def test_compile_progress_is_one_line_with_done_total_elapsed_and_estimate():
    now = [0.0]
    lines: list[str] = []
    progress = CompileProgress(4, write=lines.append, log_every=10.0, clock=lambda: now[0])
    for seconds in (5.0, 12.0, 13.0, 20.0):
        now[0] = seconds
        progress.update()
    # Logged at most every 10 s and at the end, not once per program.
    assert lines == [
        "compiling programs: 2/4 done, 12s elapsed, about 12s left",
        "compiling programs: 4/4 done, 20s elapsed",
    ]


def test_compile_progress_redraws_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    progress = CompileProgress(2, stream=screen, clock=lambda: 0.0)
    progress.update()
    progress.update()
    assert screen.getvalue().count("\n") == 1
    assert screen.getvalue().endswith("\rcompiling programs: 2/2 done, 0s elapsed\n")
