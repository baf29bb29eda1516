"""perf_bench's results as one PNG: per case, output tok/s and TTFT p99 against concurrency, one
line per system (people compare systems by looking), beside the table it prints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

# (label, ServeFigures attribute, log scale)
PANELS = (("output tok/s", "output_tok_s", False), ("TTFT p99 (ms)", "p99_ttft_ms", True))


def draw(
    results: Mapping[str, Mapping[tuple[str, int], object]],
    cases: Sequence[str],
    concurrency: Sequence[int],
    title: str,
    path: Path,
) -> Path:
    """results[system][(case, streams)]: that run's ServeFigures. Writes `path`, returns it."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    figure = Figure(figsize=(5.0 * len(PANELS), 3.4 * len(cases)), layout="constrained")
    axes = figure.subplots(len(cases), len(PANELS), squeeze=False)
    for row, case in enumerate(cases):
        for col, (label, attribute, log) in enumerate(PANELS):
            ax = axes[row][col]
            for system, runs in results.items():
                values = [getattr(runs[(case, c)], attribute) for c in concurrency]
                ax.plot(concurrency, values, marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(concurrency), [str(c) for c in concurrency])
            if log:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrent streams")
            ax.set_title(f"{case} (input x output tokens): {label}", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    return path
