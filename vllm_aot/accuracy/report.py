"""A self-contained HTML report of a logit validation: summary table and divergence plot.

The plot (matplotlib, embedded as a base64 PNG, so the file travels alone) has one panel per
top-k slice: the tolerance ratio at every position of every prompt, prompts side by side and
separated by dotted lines, on a log scale with the pass line at 1. In three-way mode HF in the
served dtype is drawn too, so one sees whether ours strays where reduced precision does.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence

from vllm_aot.accuracy.logit_tolerance import LogitComparison, slice_label
from vllm_aot.accuracy.logits import ValidationReport

_STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #bbb; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.PASS { color: #087f23; font-weight: bold; }
.FAIL { color: #c62828; font-weight: bold; }
"""


def _series(comparisons: Sequence[LogitComparison], index: int) -> list[float]:
    """Slice `index`'s ratios, prompts concatenated; zeros lifted for the log scale."""
    ratios = [r for c in comparisons for r in c.slices[index].position_ratios]
    return [max(r, 1e-6) for r in ratios]


def divergence_plot_png(report: ValidationReport) -> bytes:
    """The per-position divergence plot as PNG bytes (no pyplot, so no global figure state)."""
    from matplotlib.figure import Figure

    num_slices = len(report.slices)
    figure = Figure(figsize=(11, 2.2 * num_slices), layout="constrained")
    axes = figure.subplots(num_slices, 1, sharex=True, squeeze=False)[:, 0]
    boundaries, total = [], 0
    for comparison in report.prompts:
        total += comparison.num_positions
        boundaries.append(total)
    for index, (ax, verdict) in enumerate(zip(axes, report.slices, strict=True)):
        ax.plot(_series(report.prompts, index), lw=0.8, color="C0", label="ours")
        if report.is_three_way:
            expected = _series(report.expected_prompts, index)
            ax.plot(expected, lw=0.8, ls="--", color="C1", label=f"HF {report.dtype}")
        ax.axhline(1.0, color="C3", lw=1, label="tolerance")
        for boundary in boundaries[:-1]:
            ax.axvline(boundary - 0.5, color="grey", lw=0.5, ls=":")
        ax.set_yscale("log")
        ax.set_ylabel("ratio")
        verdict_text = "PASS" if verdict.passed else "FAIL"
        ax.set_title(f"{slice_label(verdict.top_k)}: {verdict_text}", fontsize=10, loc="left")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("position (prompts side by side)")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _table(rows: Sequence[Sequence[str]]) -> str:
    header, *body = rows
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    lines = [f"<tr>{head}</tr>"]
    for row in body:
        cells = [f"<td>{html.escape(c)}</td>" for c in row[:-1]]
        cells.append(f'<td class="{row[-1]}">{html.escape(row[-1])}</td>')
        lines.append(f"<tr>{''.join(cells)}</tr>")
    return "<table>\n" + "\n".join(lines) + "\n</table>"


def render_html(report: ValidationReport, *, title: str, notes: Sequence[str] = ()) -> str:
    """The whole report as one HTML document (table, agreement, notes, embedded plot)."""
    image = base64.b64encode(divergence_plot_png(report)).decode("ascii")
    verdict = "PASS" if report.passed else "FAIL"
    mode = "three-way (ratios vs HF float32)" if report.is_three_way else "two-way"
    agreement = f"argmax agreement {report.greedy_agreement:.1%}"
    if report.expected_greedy_agreement is not None:
        agreement += f" (HF {report.dtype}: {report.expected_greedy_agreement:.1%})"
    tolerances = ", ".join(
        f"{slice_label(v.top_k)}: atol {v.tolerance.atol:g} rtol {v.tolerance.rtol:g}"
        for v in report.slices
    )
    items = [agreement, f"tolerances: {tolerances}", *notes]
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(mode)} validation of {html.escape(report.dtype)}:
<span class="{verdict}">{verdict}</span></p>
{_table(report.summary_rows())}
<ul>{"".join(f"<li>{html.escape(item)}</li>" for item in items)}</ul>
<p>ratio = max|ours - ref| / (atol + rtol * max|ref|) per position over the slice's tokens
(the top k by reference logit); at most 1 is within tolerance.</p>
<img alt="divergence per position" src="data:image/png;base64,{image}">
</body></html>
"""
