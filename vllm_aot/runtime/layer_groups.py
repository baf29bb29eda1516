"""Layer groups: the decoder layers that share one set of weight formats, so one layer program
per bucket serves each group (`RuntimeConfig.layer_groups`).

Group 0 holds every layer no other group names, in the configuration's `weight_formats`; group g
(1, 2, ...) is `layer_groups[g - 1]`: (its layers, its overrides), each override a (linear name,
weight format) pair laid over `weight_formats` (a fused linear's part named as "qkv_proj.2",
`models/linear.py`'s `part_name`). A GGUF quantised by llama.cpp's mixes (Q4_K_M
keeps some layers' `attn_v` and `ffn_down` in more bits) reads as two or more groups
(`models/gguf.py`); every other model is one group, `layer_groups` empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Formats = tuple[tuple[str, str], ...]  # (linear name or "*", weight format), sorted
LayerGroups = tuple[tuple[tuple[int, ...], Formats], ...]  # groups 1, 2, ...: (layers, overrides)


def normal_groups(value: Iterable, format_of: Callable[[str], str]) -> LayerGroups:
    """`value` (tuples, or the lists JSON gives) as `RuntimeConfig.layer_groups` holds it: layers
    and overrides sorted, overrides equal to `format_of(linear)` (group 0's) dropped;
    ValueError for a layer in two groups, a negative layer, or a group that is empty or repeats
    another's formats."""
    groups: list[tuple[tuple[int, ...], Formats]] = []
    seen_layers: set[int] = set()
    seen_formats: set[Formats] = set()
    for layers, overrides in value:
        layers = tuple(sorted(int(i) for i in layers))
        kept = tuple(sorted((str(n), str(f)) for n, f in overrides if format_of(n) != f))
        if not layers or not kept:
            raise ValueError(
                f"layer group {layers} {kept}: every layer group names layers and formats "
                "that differ from weight_formats"
            )
        if layers[0] < 0 or seen_layers & set(layers) or len(set(layers)) < len(layers):
            raise ValueError(f"layer group {layers}: layers are indices, each in one group")
        if kept in seen_formats:
            raise ValueError(f"layer groups repeat the formats {kept}; give their layers once")
        seen_layers |= set(layers)
        seen_formats.add(kept)
        groups.append((layers, kept))
    return tuple(groups)


def layers_text(layers: Iterable[int]) -> str:
    """Layer indices as ranges: "0-1,4,7-9"."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def overrides_text(overrides: Formats) -> str:
    """A group's overrides by format: "down_proj, qkv_proj q8_0"."""
    by_format: dict[str, list[str]] = {}
    for linear, fmt in overrides:
        by_format.setdefault(fmt, []).append(linear)
    return "; ".join(f"{', '.join(names)} {fmt}" for fmt, names in by_format.items())
