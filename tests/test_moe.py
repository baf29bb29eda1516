"""The MoE families (Qwen3-MoE, Mixtral) against HF transformers, and their experts over ranks.

Routing and the MoE block against HF's modules (fp32), one decoder layer against HF's (the
test of `tests/test_models.py`, over the MoE families), the experts kernel against its pure-torch
reference (fp32 and bf16), the experts' split over simulated ranks (expert-parallel and
tensor-parallel: every rank's layer run in lockstep, its partial sums added by a lockstep
reduce, against one rank), weights in both HF layouts, refusals, and the whole model through
the runtime and `vllm-aot validate` against HF (prefill logits and teacher-forced validation:
the MoE families in tests/test_runtime.py's and tests/test_accuracy.py's parametrisations).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

from tests.helpers import needs_kernels, tiny_config
from tests.test_models import (  # the decoder layer's test, run here on the MoE families
    TIGHT,
    OurLayer,
    hf_config,
    hidden_states,
    test_decoder_layer_matches_hf_module_by_module,  # noqa: F401
)
from tests.test_runtime import hf_greedy, prompts_of_lengths
from vllm_aot import kernels
from vllm_aot.loading.startup import load_model
from vllm_aot.models.experts import REFERENCE_EXPERTS, rank_share
from vllm_aot.models.family import LayerParams
from vllm_aot.models.formats import ATEN_LINEAR
from vllm_aot.models.layers import moe_experts, route
from vllm_aot.models.linear import Rank
from vllm_aot.models.registry import arch_from_hf_config, family_of
from vllm_aot.models.source import load_arch
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.generate import GenerationRequest, Generator

MOE_FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def layer(request, tiny_model_dirs) -> OurLayer:
    """Layer 0 of a tiny MoE model, ours and HF's (`test_decoder_layer_...` takes it)."""
    return OurLayer(tiny_model_dirs(request.param))


def router_config(router: str, norm_topk_prob: bool):
    fields = dict(hidden_size=64, num_experts_per_tok=3)
    if router == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            num_experts=8, norm_topk_prob=norm_topk_prob, **fields
        ), modeling_qwen3_moe.Qwen3MoeTopKRouter
    return transformers.MixtralConfig(num_local_experts=8, **fields), (
        modeling_mixtral.MixtralTopKRouter
    )


@pytest.mark.parametrize(
    ("router", "renormalize"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]
)
@torch.no_grad()
def test_routing_matches_hf_routers(router, renormalize):
    config, router_cls = router_config(router, renormalize)
    hf = router_cls(config)
    g = torch.Generator().manual_seed(1)
    hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
    x = torch.randn(50, 64, generator=g)
    _, hf_weights, hf_ids = hf(x)
    ours = route(F.linear(x, hf.weight), 3, renormalize=renormalize)
    assert torch.equal(ours.ids, hf_ids)
    torch.testing.assert_close(ours.weights, hf_weights, **TIGHT)
    assert torch.allclose(ours.weights.sum(-1), torch.ones(50)) == renormalize


@pytest.mark.parametrize("kernel", ["reference", pytest.param("ours", marks=needs_kernels)])
@torch.no_grad()
def test_moe_block_matches_hf(layer, kernel):
    experts = kernels.experts_kernel(kernels.MOE_EXPERTS) if kernel == "ours" else None
    params = LayerParams(
        layer.arch, layer.params.spec, layer.params.kernels, layer.params.tensors,
        experts_kernel=experts or REFERENCE_EXPERTS,
    )  # fmt: skip
    h = hidden_states(layer.arch, seed=3)
    ours = params.experts("experts", h)
    torch.testing.assert_close(ours, layer.hf_layer.mlp(h[None])[0], **TIGHT)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.no_grad()
def test_bf16_experts_are_no_further_from_fp32_than_hf_bf16(tiny_model_dirs, family):
    """The same routing (whole-model bfloat16 routing flips at near-ties, as HF's own does:
    docs/model-bringup.md), through our experts in bfloat16 and HF's, against HF's in fp32."""
    model_dir = tiny_model_dirs(family)
    hf = {
        dtype: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }
    arch = load_arch(model_dir)
    h = hidden_states(arch, seed=4).bfloat16()
    routing = route(hf[torch.float32].model.layers[1].mlp.gate(h.float())[0], 2, renormalize=True)
    truth = hf[torch.float32].model.layers[1].mlp.experts(h.float(), *routing)
    theirs = hf[torch.bfloat16].model.layers[1].mlp.experts(h, *routing).float()
    weights = load_weights(model_dir, arch, torch.bfloat16).layers[1]
    kernel = kernels.experts_kernel(kernels.experts_impl())
    stacked = (weights[f"experts.{n}"] for n in ("w13", "w2", "first_expert"))
    ours = kernel.apply(h, *routing, *stacked).float()
    ours_error, their_error = (ours - truth).abs(), (theirs - truth).abs()
    assert ours_error.max() <= their_error.max() and ours_error.mean() <= their_error.mean()


def experts_case(dtype, *, num_rank_experts=8, first=0, tokens=37, hidden=256, inter=96):
    """Routed tokens over 8 experts, top-2, and one rank's experts' weights."""
    g = torch.Generator().manual_seed(num_rank_experts * 10 + first)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routing = route(torch.randn(tokens, 8, generator=g), 2, renormalize=True)
    w13 = (torch.randn(num_rank_experts, 2 * inter, hidden, generator=g) / 16).to(dtype)
    w2 = (torch.randn(num_rank_experts, hidden, inter, generator=g) / 10).to(dtype)
    return x, routing.ids, routing.weights, w13, w2, torch.tensor(first)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_linear_bf16", [False, True])
@pytest.mark.parametrize(("num_rank_experts", "first"), [(8, 0), (4, 4), (3, 2), (2, 8)])
def test_experts_kernel_matches_reference(dtype, use_linear_bf16, num_rank_experts, first):
    """All experts, a rank's half, a range cutting through the routed ones, and experts no
    token is routed to (ids 8, 9: the output is zeros)."""
    kernels.load()
    case = experts_case(dtype, num_rank_experts=num_rank_experts, first=first)
    got = torch.ops.vllm_aot.moe_experts(*case, use_linear_bf16)
    want = moe_experts(*case)
    assert got.dtype == dtype and got.shape == case[0].shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **TIGHT)
    else:  # bfloat16 products rounded in another order: an ulp here and there
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if first >= 8:
        assert not got.any()


def test_expert_parallel_partial_sums_equal_one_rank_exactly(tiny_model_dirs):
    """Two EP ranks' MoE blocks (half the experts each, reduce an identity) summed are the one
    rank's block, bit for bit: top-2 contributions added in the same order from zero."""
    model_dir = tiny_model_dirs("mixtral")
    arch = load_arch(model_dir)
    h = hidden_states(arch, seed=5)
    whole = rank_params(model_dir, arch, Rank(0, 1)).experts("experts", h)
    ranks = [Rank(i, 2, is_expert_parallel=True) for i in range(2)]
    parts = [rank_params(model_dir, arch, rank).experts("experts", h) for rank in ranks]
    assert torch.equal(parts[0] + parts[1], whole)
    assert parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0


def rank_params(model_dir, arch, rank: Rank, reduce=None, kernel=REFERENCE_EXPERTS):
    """Layer 0's parameters as `rank` holds them (its share of the architecture and weights)."""
    local = arch.for_rank(rank.size, expert_parallel=rank.is_expert_parallel)
    spec = family_of(arch).layer_spec(local, "fp32")
    weights = load_weights(model_dir, arch, torch.float32, rank=rank).layers[0]
    extra = {"reduce": reduce} if reduce else {}
    return LayerParams(local, spec, {"fp32": ATEN_LINEAR}, weights, experts_kernel=kernel, **extra)


class LockstepReduce:
    """An all-reduce between rank threads: each waits for every rank's partial, all get their
    sum in rank order (one reduce at a time, as ranks run the same maths)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)  # a failed rank breaks it
        self.partials: dict[int, torch.Tensor] = {}

    def for_rank(self, index: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            self.partials[index] = partial
            self.barrier.wait()
            total = sum(self.partials[i] for i in sorted(self.partials))
            self.barrier.wait()  # everyone has read before the next reduce writes
            return total

        return reduce


def run_ranks(layer: OurLayer, ranks: list[Rank], x: torch.Tensor, kernel) -> list[tuple]:
    """The decoder layer on every rank in its own thread, reducing in lockstep -> per rank
    (hidden, k, v)."""
    lockstep = LockstepReduce(len(ranks))
    results: dict[int, tuple] = {}

    def run(rank: Rank) -> None:
        reduce = lockstep.for_rank(rank.index)
        params = rank_params(layer.model_dir, layer.arch, rank, reduce, kernel)
        results[rank.index] = layer.forward(x, {}, params)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == len(ranks), "a rank failed (see the thread's exception above)"
    return [results[i] for i in range(len(ranks))]


@pytest.mark.parametrize("is_expert_parallel", [True, False], ids=["ep2", "tp2"])
@pytest.mark.parametrize("kernel", ["reference", pytest.param("ours", marks=needs_kernels)])
@torch.no_grad()
def test_two_ranks_decoder_layer_equals_one_rank(layer, is_expert_parallel, kernel):
    """Attention split by heads and experts by expert (EP) or by intermediate features (TP):
    each rank's hidden output is the one-rank layer's, its K/V that layer's heads."""
    experts = kernels.experts_kernel(kernels.MOE_EXPERTS) if kernel == "ours" else None
    x = hidden_states(layer.arch, seed=7)
    whole, k, v = layer.forward(x, {})
    ranks = [Rank(i, 2, is_expert_parallel) for i in range(2)]
    outputs = run_ranks(layer, ranks, x, experts or REFERENCE_EXPERTS)
    for hidden, _, _ in outputs:
        torch.testing.assert_close(hidden, whole, **TIGHT)
    torch.testing.assert_close(torch.cat([o[1] for o in outputs], dim=1), k, **TIGHT)
    torch.testing.assert_close(torch.cat([o[2] for o in outputs], dim=1), v, **TIGHT)


def test_weights_load_from_either_hf_layout(tiny_model_dirs, tmp_path):
    """transformers 5's own layout (stacked experts; Mixtral's block named `mlp`) gives the
    tensors `save_pretrained`'s per-expert layout gives."""
    for family in MOE_FAMILIES:
        model_dir = tiny_model_dirs(family)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        stacked = tmp_path / family
        hf.save_pretrained(stacked, save_original_format=False)
        from safetensors import safe_open

        with safe_open(str(stacked / "model.safetensors"), "pt") as f:
            assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
        arch = load_arch(model_dir)
        for rank in (Rank(0, 1), Rank(1, 2, is_expert_parallel=True), Rank(1, 2)):
            ours = load_weights(stacked, arch, torch.float32, rank=rank).layers[1]
            theirs = load_weights(model_dir, arch, torch.float32, rank=rank).layers[1]
            assert ours.keys() == theirs.keys()
            for name, tensor in theirs.items():
                assert torch.equal(ours[name], tensor), f"{family} {rank}: {name}"


def test_a_rank_holds_its_experts_and_names_the_first(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3_moe")
    arch = load_arch(model_dir)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.intermediate_size) == (8, 2, 48)
    rank1 = load_weights(model_dir, arch, torch.float32, rank=Rank(1, 2, True)).layers[0]
    whole = load_weights(model_dir, arch, torch.float32).layers[0]
    assert int(rank1["experts.first_expert"]) == 4
    assert torch.equal(rank1["experts.w13"], whole["experts.w13"][4:])
    assert torch.equal(rank1["experts.router"], whole["experts.router"])
    local = arch.for_rank(2, expert_parallel=True)
    shapes = family_of(arch).layer_spec(local, "fp32").example_tensors(torch.float32)
    assert {n: tuple(t.shape) for n, t in shapes.items() if n in rank1} == {
        n: tuple(t.shape) for n, t in rank1.items()
    }
    tp = arch.for_rank(2)
    assert (tp.intermediate_size, tp.num_experts_per_rank) == (24, 8)
    assert rank_share(arch, Rank(1, 2, True)) == "experts 4-7 of 8 (expert parallel)"
    assert rank_share(arch, Rank(1, 2)) == "all 8 experts, 1/2 of each one's intermediate features"


def hf_moe_config(architecture: str, **fields) -> dict:
    """`test_models.hf_config` with both MoE families' expert fields."""
    experts = dict(moe_intermediate_size=32, num_experts=8, num_local_experts=8)
    return hf_config(architecture, **{**experts, "num_experts_per_tok": 2, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(mlp_only_layers=[1]), "mlp_only_layers=\\[1\\] is not supported"),
        (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported; supported: 1"),
        (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size=64"),
        (dict(num_experts=0, num_local_experts=0), "num_experts=0 is not supported"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 and 8 experts"),
        (dict(use_sliding_window=True), "use_sliding_window=true"),
    ],
)
def test_qwen3_moe_refuses_what_one_layer_program_cannot_serve(fields, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(hf_moe_config("Qwen3MoeForCausalLM", **fields))


def test_expert_weights_refuse_quantised_formats_and_uneven_splits(tiny_model_dirs):
    mixtral = arch_from_hf_config(hf_moe_config("MixtralForCausalLM", sliding_window=512))
    assert (mixtral.sliding_window, mixtral.norm_topk_prob, mixtral.intermediate_size) == (
        512,
        True,
        128,
    )
    spec = family_of(mixtral).layer_spec(mixtral, "fp32")
    with pytest.raises(ValueError, match=r"expert weights in 'int8' .* supported: fp32, bf16"):
        spec.with_formats(lambda name: "int8")
    config = tiny_config(quantization="int8")
    with pytest.raises(ValueError, match="expert weights in 'int8'"):
        load_model(tiny_model_dirs("mixtral"), config, show_progress=False)
    six_heads = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    three_ways = arch_from_hf_config(hf_moe_config("MixtralForCausalLM", **six_heads))
    with pytest.raises(ValueError, match=r"experts \(8\) do not split evenly over .* size 3"):
        three_ways.for_rank(3, expert_parallel=True)
    assert mixtral.for_rank(4, expert_parallel=True).num_experts_per_rank == 2
    dense = arch_from_hf_config({**hf_moe_config("LlamaForCausalLM")})
    with pytest.raises(ValueError, match="no experts to split"):
        dense.for_rank(2, expert_parallel=True)
    assert "num_experts" not in dense.digest_fields()  # dense digests are what they were
    assert mixtral.digest_fields()["num_experts"] == 8


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_generation_matches_hf(tiny_model_dirs, family):
    """Prompts joining and leaving a 4-row batch: prefill chunks, shared decode batches."""
    model_dir = tiny_model_dirs(family)
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    prompts = prompts_of_lengths(5, 40, 90, 17, 3)
    results = Generator(model).generate([GenerationRequest(p, max_tokens=12) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(model_dir, prompt, 12), f"prompt of {len(prompt)}"


@pytest.mark.parametrize(
    ("family", "ranks"),
    [
        ("qwen3_moe", []),
        ("mixtral", []),
        pytest.param(  # ~25 s; expert parallelism stays in the fast suite (test_tensor_parallel)
            "mixtral",
            ["--tensor-parallel-size=2", "--enable-expert-parallel"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["qwen3_moe", "mixtral", "mixtral-ep2"],
)
def test_validate_command_passes_against_hf(tiny_model_dirs, family, ranks):
    """`vllm-aot validate` in fp32 at its default tolerances, greedy text equal to HF's, on one
    rank and on two holding 4 experts each. (In bfloat16 the tiny models' three-way verdict is
    decided by a few near-tie routing choices: docs/model-bringup.md; the bf16 experts are
    tested above.)"""
    from tests.test_accuracy_tools import TINY_CLI_CONFIG
    from vllm_aot.cli.main import main

    args = [*TINY_CLI_CONFIG, "--num-tokens=16", *ranks]
    assert main(["validate", str(tiny_model_dirs(family)), *args]) == 0


@needs_kernels
def test_compiled_layer_program_with_the_experts_kernel_matches_eager(tiny_model_dirs, tmp_path):
    """AOTInductor compiles a Mixtral prefill layer calling our op (its Meta shape function
    under export) and runs it as the eager module does (fp32)."""
    from vllm_aot.runtime.backends import eager_program, load_program
    from vllm_aot.runtime.compiler import compile_program
    from vllm_aot.runtime.programs import ProgramKey, ProgramKind, example_args
    from vllm_aot.runtime.signature import flatten

    model_dir = tiny_model_dirs("mixtral")
    arch, config = load_arch(model_dir), tiny_config(backend="inductor")
    key = ProgramKey(ProgramKind.PREFILL, 64, 0)
    compile_program(key, arch, config, tmp_path / "layer.pt2")
    weights = load_weights(model_dir, arch, torch.float32).layers[0]
    args = example_args(key, arch, config)
    x = hidden_states(arch, seed=9).repeat(4, 1)[:64]
    assert args.hidden.shape == x.shape
    inputs = flatten(args._replace(hidden=x, weights=tuple(weights.values())))
    compiled = load_program(tmp_path / "layer.pt2", config)(*inputs)
    eager = eager_program(key, arch, config)(*inputs)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, **TIGHT)
