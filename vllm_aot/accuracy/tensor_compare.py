"""Tensor compare: two captures of the same tokens, aligned by module name and position.

The error at a position is relative L-inf over that position's features,
max|ours - ref| / max|ref|, so one number per module per position reads the same for hidden
states, K/V and logits. A module diverges when any position exceeds the tolerance; the report
names the first module in forward order that does, and its first position beyond tolerance.
Default tolerances: 1e-3 when both captures are float32 (two correct fp32 implementations agree
to ~1e-5), 5e-2 otherwise (bf16 rounding alone, accumulated over layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_aot.accuracy.capture import Capture, module_order

DEFAULT_RTOL = {"float32": 1e-3}
REDUCED_PRECISION_RTOL = 5e-2


def default_tolerance(a: Capture, b: Capture) -> float:
    is_fp32 = a.dtype == b.dtype == "float32"
    return DEFAULT_RTOL["float32"] if is_fp32 else REDUCED_PRECISION_RTOL


@dataclass(frozen=True)
class ModuleDiff:
    """One module's output, ours against the reference, over every position."""

    name: str
    worst_error: float  # max over positions of max|a - b| / max|b| at that position
    worst_position: int
    first_bad_position: int | None  # first position beyond tolerance; None = within everywhere
    rel_l2: float  # ||a - b|| / ||b|| over all positions and features

    @property
    def is_diverged(self) -> bool:
        return self.first_bad_position is not None


@dataclass(frozen=True)
class TensorComparison:
    """Every module present in both captures, in forward order."""

    tolerance: float
    modules: tuple[ModuleDiff, ...]
    only_in_ours: tuple[str, ...]
    only_in_reference: tuple[str, ...]

    @property
    def first_divergence(self) -> ModuleDiff | None:
        """The first module (forward order) beyond tolerance at some position."""
        return next((m for m in self.modules if m.is_diverged), None)

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def module(self, name: str) -> ModuleDiff:
        for diff in self.modules:
            if diff.name == name:
                return diff
        raise KeyError(f"no module {name!r} in both captures")

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = [("module", "worst rel L-inf", "at pos", "rel L2", "first bad pos")]
        for m in self.modules:
            first = "-" if m.first_bad_position is None else str(m.first_bad_position)
            row = (m.name, f"{m.worst_error:.3g}", str(m.worst_position), f"{m.rel_l2:.3g}", first)
            rows.append(row)
        return rows

    def verdict(self) -> str:
        first = self.first_divergence
        if first is None:
            return f"no module diverges beyond {self.tolerance:g}"
        return (
            f"first divergence: {first.name} at position {first.first_bad_position} "
            f"(rel L-inf {first.worst_error:.3g} > {self.tolerance:g})"
        )


def position_errors(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[positions] max|ours - ref| / max|ref| over each position's features (NaN -> inf)."""
    a, b = ours.flatten(1).double(), ref.flatten(1).double()
    error = (a - b).abs().amax(dim=1) / b.abs().amax(dim=1).clamp_min(1e-30)
    return torch.where(error.isnan(), torch.inf, error)


def diff_module(name: str, ours: torch.Tensor, ref: torch.Tensor, tolerance: float) -> ModuleDiff:
    if ours.shape != ref.shape:
        raise ValueError(f"{name}: shape {tuple(ours.shape)} vs reference {tuple(ref.shape)}")
    errors = position_errors(ours, ref)
    bad = (errors > tolerance).nonzero()
    a, b = ours.double(), ref.double()
    return ModuleDiff(
        name=name,
        worst_error=float(errors.max()),
        worst_position=int(errors.argmax()),
        first_bad_position=int(bad[0, 0]) if len(bad) else None,
        rel_l2=float((a - b).norm() / b.norm().clamp_min(1e-30)),
    )


def compare_captures(
    ours: Capture, reference: Capture, tolerance: float | None = None
) -> TensorComparison:
    """Align by name and position; ValueError when the captures are of different tokens."""
    if ours.token_ids != reference.token_ids:
        raise ValueError("the captures are of different token sequences; capture the same tokens")
    tolerance = default_tolerance(ours, reference) if tolerance is None else tolerance
    common = sorted(set(ours.tensors) & set(reference.tensors), key=module_order)
    modules = tuple(
        diff_module(n, ours.tensors[n], reference.tensors[n], tolerance) for n in common
    )
    return TensorComparison(
        tolerance=tolerance,
        modules=modules,
        only_in_ours=tuple(sorted(set(ours.tensors) - set(common), key=module_order)),
        only_in_reference=tuple(sorted(set(reference.tensors) - set(common), key=module_order)),
    )
