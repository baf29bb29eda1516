"""perf_bench's plot: a PNG with a panel per case and measure, whatever systems ran."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from perf_plot import draw


def test_draw_writes_one_png_for_every_case_and_system(tmp_path):
    def run(tok_s, ttft):
        return SimpleNamespace(output_tok_s=tok_s, p99_ttft_ms=ttft)

    results = {
        system: {
            (case, c): run(scale * c, 100.0 * c) for case in ("128x128", "1024x128") for c in (1, 8)
        }
        for system, scale in (("ours", 2.0), ("llamacpp", 1.0))
    }
    path = draw(results, ["128x128", "1024x128"], [1, 8], "title", tmp_path / "perf.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000  # two rows of two panels, not an empty canvas
