"""A program's inputs, declared once: a NamedTuple whose fields are its arguments, in order.

Each field says what it holds in its annotation, `Annotated[..., spec]`:

- `Arg(shape, dtype, fill)`: one tensor. `shape` names its dimensions (numbers stand for
  themselves), which a bucket's `Sizes` resolve; a `Dynamic` dimension varies between calls.
- `Tensors(name)`: a run of tensors whose number the program fixes when it is built (a layer's
  weights, the LM head's stored tensors); at most one such field in a record, nested ones
  included (its length is what the other fields leave of a call).
- a record itself (a NamedTuple of such fields, unannotated): its tensors in its place.

Everything else follows from the record: the flat tuple of tensors a program is called with and
compiled for (`flatten`, in field order), the record a program rebuilds from it (`unflatten`),
example inputs of a bucket's shapes (`example`) and the dimensions `torch.export` leaves
symbolic (`dynamic_shapes`). Adding an input is one field, plus the code that fills it.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Dynamic:
    """A dimension that varies between calls of one program: exported symbolic in [min, max],
    `example` in example inputs."""

    name: str
    example: int
    min: int
    max: int


@dataclass(frozen=True)
class Arg:
    """One tensor input: its dimensions (names `Sizes.dims` resolves, numbers, `Dynamic`), its
    dtype (a torch dtype, or a name `Sizes.dtypes` resolves) and the value examples hold."""

    shape: tuple[str | int | Dynamic, ...]
    dtype: torch.dtype | str
    fill: float | bool = 0


@dataclass(frozen=True)
class Tensors:
    """A run of tensors fixed when the program is built; examples from `Sizes.tensors[name]`."""

    name: str


@dataclass(frozen=True)
class Sizes:
    """What a bucket's example inputs resolve names to."""

    dims: Mapping[str, int | tuple[int, ...]]  # a tuple: several dimensions in the name's place
    dtypes: Mapping[str, torch.dtype]
    tensors: Mapping[str, Callable[[], tuple[torch.Tensor, ...]]]  # built only when asked


class _Leaf(NamedTuple):
    path: str  # dotted field names from the record down ("sampling.top_k")
    spec: Arg | Tensors


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")


@functools.cache
def _specs(record: type) -> tuple[Arg | Tensors | type, ...]:
    """Each field's spec, or its record type where it is one."""
    hints = typing.get_type_hints(record, include_extras=True)
    specs: list[Arg | Tensors | type] = []
    for name in record._fields:
        hint = hints[name]
        found = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Arg | Tensors)]
        if not found and not _is_record(hint):
            raise TypeError(f"{record.__name__}.{name}: annotate it with Arg or Tensors")
        specs.append(found[0] if found else hint)
    return tuple(specs)


@functools.cache
def leaves(record: type) -> tuple[_Leaf, ...]:
    """The record's inputs in call order, nested records' spread in their place."""
    found: list[_Leaf] = []
    for name, spec in zip(record._fields, _specs(record), strict=True):
        if isinstance(spec, Arg | Tensors):
            found.append(_Leaf(name, spec))
        else:
            found += [_Leaf(f"{name}.{leaf.path}", leaf.spec) for leaf in leaves(spec)]
    assert sum(isinstance(leaf.spec, Tensors) for leaf in found) <= 1, (
        f"{record.__name__}: at most one Tensors field"
    )
    return tuple(found)


def _display(record: type, prefix: str) -> str:
    """A tuple display of the record's leaves, each read from `prefix` + its path."""
    parts = [
        f"{'*' if isinstance(leaf.spec, Tensors) else ''}{prefix}{leaf.path}"
        for leaf in leaves(record)
    ]
    return f"({', '.join(parts)},)"


@functools.cache
def _flattener(record: type) -> Callable[[Any], tuple[torch.Tensor, ...]]:
    return eval(f"lambda r: {_display(record, 'r.')}")  # names are a NamedTuple's fields


@functools.cache
def flat_call(record: type) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A function of `record`'s fields, by keyword, returning `flatten(record(**fields))`
    without building the record: the call of a program run once per layer per step, at a
    fifth of the cost."""
    fields = ", ".join(record._fields)
    return eval(f"lambda *, {fields}: {_display(record, '')}")  # names are a NamedTuple's fields


@functools.cache
def _num_args(record: type) -> int:
    """The record's inputs besides its `Tensors` run."""
    return sum(isinstance(leaf.spec, Arg) for leaf in leaves(record))


def flatten(args: tuple) -> tuple[torch.Tensor, ...]:
    """A record as its program takes it: its tensors, flat, in field order."""
    return _flattener(type(args))(args)


def unflatten(record: type, flat: tuple[torch.Tensor, ...]):
    """The `record` a flat call (`flatten`'s) holds."""
    num_run = len(flat) - _num_args(record)
    assert num_run >= 0, f"{len(flat)} inputs are too few for {record.__name__}"
    value, end = _build(record, flat, 0, num_run)
    assert end == len(flat), f"{len(flat)} inputs are too many for {record.__name__}"
    return value


def _build(record: type, flat: tuple, start: int, num_run: int) -> tuple[Any, int]:
    values = []
    for spec in _specs(record):
        if isinstance(spec, Tensors):
            values.append(tuple(flat[start : start + num_run]))
            start += num_run
        elif isinstance(spec, Arg):
            values.append(flat[start])
            start += 1
        else:
            value, start = _build(spec, flat, start, num_run)
            values.append(value)
    return record(*values), start


def _shape(spec: Arg, sizes: Sizes) -> tuple[int, ...]:
    shape: list[int] = []
    for dim in spec.shape:
        if isinstance(dim, Dynamic):
            # its axis is its place in `shape` (`dynamic_shapes`): no name of several before it
            assert len(shape) == spec.shape.index(dim), f"{spec}: a name of several dims first"
            shape.append(dim.example)
        elif isinstance(dim, str):
            size = sizes.dims[dim]
            shape += size if isinstance(size, tuple) else [size]
        else:
            shape.append(dim)
    return tuple(shape)


def example(record: type, sizes: Sizes):
    """A `record` of example tensors: each `Arg`'s shape and dtype, holding its `fill`."""
    flat: list[torch.Tensor] = []
    for leaf in leaves(record):
        spec = leaf.spec
        if isinstance(spec, Tensors):
            flat += sizes.tensors[spec.name]()
            continue
        dtype = sizes.dtypes[spec.dtype] if isinstance(spec.dtype, str) else spec.dtype
        shape = _shape(spec, sizes)
        tensor = torch.zeros(shape, dtype=dtype)  # fp8 has zeros but no full
        flat.append(tensor.fill_(spec.fill) if spec.fill else tensor)
    return unflatten(record, tuple(flat))


def dynamic_shapes(record: type, num_inputs: int):
    """`torch.export`'s dynamic shapes for a program `forward(*flat)` taking `record`'s
    `num_inputs` tensors; None where every dimension is static."""
    num_run = num_inputs - _num_args(record)
    dims: dict[str, torch.export.Dim] = {}
    specs: list[dict | None] = []
    for leaf in leaves(record):
        if isinstance(leaf.spec, Tensors):
            specs += [None] * num_run
            continue
        axes = {
            axis: dims.setdefault(dim.name, torch.export.Dim(dim.name, min=dim.min, max=dim.max))
            for axis, dim in enumerate(leaf.spec.shape)
            if isinstance(dim, Dynamic)
        }
        specs.append(axes or None)
    return (tuple(specs),) if dims else None
