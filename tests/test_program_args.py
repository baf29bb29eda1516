"""Program inputs declared once (`runtime/program_args.py`): the flat call, the record rebuilt
from it, examples and dynamic shapes all follow the record's fields."""

from __future__ import annotations

from typing import Annotated, NamedTuple

import pytest
import torch

from tests.helpers import tiny_arch, tiny_config
from vllm_aot.runtime.program_args import BLOCKS, LayerArgs
from vllm_aot.runtime.programs import all_program_keys, dynamic_shapes, example_args
from vllm_aot.runtime.signature import Arg, Tensors, flat_call, flatten, unflatten

pytestmark = pytest.mark.unit


def _keys():
    config = tiny_config(num_speculative_tokens=2)
    return [(k, config) for k in all_program_keys(config)] + [
        (k, tiny_config(runner="pooling")) for k in all_program_keys(tiny_config(runner="pooling"))
    ]


@pytest.mark.parametrize("key, config", _keys(), ids=lambda x: getattr(x, "name", ""))
def test_a_programs_flat_call_gives_back_its_record(key, config):
    args = example_args(key, tiny_arch(), config)
    flat = flatten(args)
    assert all(isinstance(t, torch.Tensor) for t in flat)
    again = unflatten(type(args), flat)
    assert type(again) is type(args)
    assert all(a is b for a, b in zip(flatten(again), flat, strict=True))
    assert flat_call(type(args))(**args._asdict()) == flat
    shapes = dynamic_shapes(key, flat)
    if isinstance(args, LayerArgs):  # the pools' blocks, alone
        (specs,) = shapes
        dynamic = [i for i, spec in enumerate(specs) if spec]
        assert [flat[i] for i in dynamic] == [args.k_pool, args.v_pool]
        assert all(specs[i][0].__name__ == BLOCKS.name for i in dynamic)
    else:
        assert shapes is None


def test_an_added_field_is_one_line_and_a_field_without_a_spec_is_refused():
    class Base(NamedTuple):
        hidden: Annotated[torch.Tensor, Arg(("tokens",), torch.float32)]
        weights: Annotated[tuple[torch.Tensor, ...], Tensors("weights")]

    class Added(NamedTuple):
        hidden: Annotated[torch.Tensor, Arg(("tokens",), torch.float32)]
        adapter: Annotated[torch.Tensor, Arg(("tokens",), torch.int32)]
        weights: Annotated[tuple[torch.Tensor, ...], Tensors("weights")]

    h, a, w = torch.zeros(2), torch.zeros(2, dtype=torch.int32), (torch.ones(1), torch.ones(3))
    assert flatten(Base(h, w)) == (h, *w)
    assert flatten(Added(hidden=h, adapter=a, weights=w)) == (h, a, *w)
    assert unflatten(Added, (h, a, *w)).weights == w

    class Bare(NamedTuple):
        hidden: torch.Tensor

    with pytest.raises(TypeError, match=r"Bare\.hidden"):
        flatten(Bare(h))
