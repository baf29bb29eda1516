"""Each family's modules against HF transformers' modules of the same layer with the same weights
(fp32, eager, tiny seeded models): RMSNorm, rotary, the MLP and one whole decoder layer over a
fresh sequence; what each family file states (parameters, fusions, refusals); and a family added
in this file alone (Phi-3, whose HF checkpoint already fuses q|k|v and gate|up) running end to
end, as `docs/model-bringup.md` says an addition should."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models import llama, registry
from vllm_aot.models.config import (
    ModelArch,
    decoder_arch_from_hf,
    load_hf_config,
    rope_from_hf,
)
from vllm_aot.models.family import Family, LayerParams, LayerSpec, Norm
from vllm_aot.models.formats import ATEN_LINEAR
from vllm_aot.models.layers import (
    PagedKV,
    apply_rotary,
    prefill_attention,
    rms_norm,
    rotary_cos_sin,
)
from vllm_aot.models.linear import Shard
from vllm_aot.models.registry import arch_from_hf_config, family_of
from vllm_aot.models.source import load_arch
from vllm_aot.models.tiny import make_tiny_model
from vllm_aot.models.weights import load_weights
from vllm_aot.runtime.inputs import PrefillChunk

pytestmark = pytest.mark.unit

FAMILIES = ("llama", "qwen2", "qwen3")
NUM_TOKENS = 21
# fp32 through the same operations in a different order: differences are float32 rounding.
TIGHT = dict(rtol=1e-5, atol=1e-5)


class OurLayer:
    """Layer 0 of a tiny model as our family maths sees it, beside HF's `hf.model.layers[0]`."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.arch = load_arch(model_dir)
        self.family = family_of(self.arch)
        weights = load_weights(model_dir, self.arch, torch.float32)
        spec = self.family.layer_spec(self.arch, "fp32")
        self.params = LayerParams(self.arch, spec, {"fp32": ATEN_LINEAR}, weights.layers[0])
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.hf_layer = self.hf.model.layers[0]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.arch.rope.inv_freq(), torch.float32)

    def forward(
        self,
        x: torch.Tensor,
        observed: dict[str, torch.Tensor],
        params: LayerParams | None = None,
    ):
        """The family's decoder layer over a fresh sequence: prefill attention, empty cache;
        with `params`, a rank's (its own heads, a pool of its KV heads)."""
        params = params or self.params
        shape = (1, 16, params.arch.num_kv_heads, params.arch.head_dim)
        empty_pool = torch.zeros(shape)
        no_context = torch.zeros(0, dtype=torch.int64)
        causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()

        def attend(q, k, v):
            cache = PagedKV(empty_pool, empty_pool, torch.ones(()), torch.ones(()))
            return prefill_attention(q, k, v, cache, no_context, causal)

        return self.family.decoder_layer(
            x,
            rope=self.rope(torch.arange(len(x))),
            attend=attend,
            params=params,
            observe=observed.__setitem__,
        )


@pytest.fixture(scope="module", params=FAMILIES)
def layer(request, tiny_model_dirs) -> OurLayer:
    return OurLayer(tiny_model_dirs(request.param))


def hidden_states(arch, seed: int = 0) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, arch.hidden_size, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_rms_norm_matches_hf(layer):
    x = hidden_states(layer.arch)
    ours = rms_norm(x, layer.params.norm("post_attention_layernorm"), layer.arch.rms_norm_eps)
    torch.testing.assert_close(ours, layer.hf_layer.post_attention_layernorm(x), **TIGHT)


@torch.no_grad()
def test_rotary_matches_hf(layer):
    positions = torch.arange(NUM_TOKENS) * 37  # far positions too, where angles wrap
    cos, sin = layer.rope(positions)
    hf_cos, hf_sin = layer.hf.model.rotary_emb(torch.zeros(1), positions[None])
    torch.testing.assert_close((cos, sin), (hf_cos[0], hf_sin[0]), **TIGHT)
    q = torch.randn(NUM_TOKENS, layer.arch.num_heads, layer.arch.head_dim)
    rotate = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    hf_q, _ = rotate(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), **TIGHT)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
)
def test_scaled_rotary_matches_hf(rope_parameters):
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters=rope_parameters
    )
    spec = rope_from_hf(config.to_dict(), head_dim=16)
    positions = torch.arange(0, 4000, 97)
    hf_cos, hf_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(
        torch.zeros(1), positions[None]
    )
    ours = rotary_cos_sin(positions, spec.inv_freq(), torch.float32)
    torch.testing.assert_close(ours, (hf_cos[0], hf_sin[0]), **TIGHT)


@torch.no_grad()
def test_mlp_matches_hf(layer):
    h = hidden_states(layer.arch)
    torch.testing.assert_close(llama.mlp(h, layer.params), layer.hf_layer.mlp(h), **TIGHT)


@torch.no_grad()
def test_decoder_layer_matches_hf_module_by_module(layer):
    """Output, new K/V (post-rotary, as HF caches them) and every observed sub-layer output."""
    x = hidden_states(layer.arch)
    observed: dict[str, torch.Tensor] = {}
    ours, k, v = layer.forward(x, observed)

    hf_outputs: dict[str, torch.Tensor] = {}
    hooks = [
        layer.hf_layer.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: hf_outputs.__setitem__(name, out)
        )
        for name in observed
    ]
    cache = transformers.DynamicCache(config=layer.hf.config)
    causal = torch.full((NUM_TOKENS, NUM_TOKENS), float("-inf")).triu(1)[None, None]
    positions = torch.arange(NUM_TOKENS)[None]
    hf_out = layer.hf_layer(
        x[None],
        attention_mask=causal,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        position_embeddings=layer.hf.model.rotary_emb(x, positions),
    )
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(ours, hf_out[0], **TIGHT)
    torch.testing.assert_close(k, cache.layers[0].keys[0].transpose(0, 1), **TIGHT)
    torch.testing.assert_close(v, cache.layers[0].values[0].transpose(0, 1), **TIGHT)
    assert set(observed) == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
    for name, tensor in observed.items():
        hf_tensor = hf_outputs[name][0] if name == "self_attn" else hf_outputs[name]
        torch.testing.assert_close(tensor, hf_tensor[0], **TIGHT, msg=name)


def test_weights_are_the_hf_tensors_fused_in_the_spec_order(tiny_model_dirs):
    from safetensors.torch import load_file

    model_dir = tiny_model_dirs("qwen2")
    arch = load_arch(model_dir)
    layer = load_weights(model_dir, arch, torch.float32).layers[1]
    hf = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.1.self_attn."
    qkv = [hf[f"{prefix}{n}_proj.weight"] for n in "qkv"]
    torch.testing.assert_close(layer["qkv_proj.weight"], torch.cat(qkv), rtol=0, atol=0)
    bias = torch.cat([hf[f"{prefix}{n}_proj.bias"] for n in "qkv"])
    torch.testing.assert_close(layer["qkv_proj.bias"], bias, rtol=0, atol=0)
    assert tuple(layer) == family_of(arch).layer_spec(arch, "fp32").tensor_names()


@pytest.mark.parametrize(
    ("family", "extras"),
    [
        ("llama", set()),
        ("qwen2", {"qkv_proj.bias"}),
        ("qwen3", {"q_norm.weight", "k_norm.weight"}),
    ],
)
def test_each_family_states_its_extras_and_shards(tiny_model_dirs, family, extras):
    arch = load_arch(tiny_model_dirs(family))
    spec = family_of(arch).layer_spec(arch, "bf16")
    plain = {"input_layernorm", "post_attention_layernorm", "qkv_proj", "o_proj"}
    plain = {f"{name}.weight" for name in plain | {"gate_up_proj", "down_proj"}}
    assert set(spec.tensor_names()) == plain | extras
    shards = {linear.name: linear.shard for linear in spec.linears()}
    assert shards == {
        "qkv_proj": Shard.COLUMN,
        "o_proj": Shard.ROW,
        "gate_up_proj": Shard.COLUMN,
        "down_proj": Shard.ROW,
    }
    assert {linear.format for linear in spec.linears()} == {"bf16"}


def hf_config(architecture: str, **fields) -> dict:
    return {
        "architectures": [architecture],
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        **fields,
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (hf_config("LlamaForCausalLM", hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (hf_config("LlamaForCausalLM", attention_bias=True), "attention_bias=true is not"),
        (hf_config("Qwen3ForCausalLM", attention_bias=True), "attention_bias=true is not"),
        (hf_config("MistralForCausalLM", mlp_bias=True), "mlp_bias=true is not supported"),
        (hf_config("Qwen2ForCausalLM", use_sliding_window=True), "use_sliding_window=true"),
        (hf_config("Qwen3ForCausalLM", use_sliding_window=True), "use_sliding_window=true"),
        (
            hf_config("GPT2LMHeadModel"),
            "supported: BertModel, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2",
        ),
    ],
)
def test_families_refuse_what_they_do_not_implement(config, message):
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config)


def test_only_mistral_keeps_its_sliding_window_and_qwen2_its_bias():
    window = dict(sliding_window=512)
    assert arch_from_hf_config(hf_config("MistralForCausalLM", **window)).sliding_window == 512
    assert arch_from_hf_config(hf_config("LlamaForCausalLM", **window)).sliding_window is None
    assert arch_from_hf_config(hf_config("Qwen2ForCausalLM", **window)).sliding_window is None
    qwen2 = arch_from_hf_config(hf_config("Qwen2ForCausalLM", attention_bias=True))
    assert qwen2.family == "qwen2"


# --- A family brought up in one file: Phi-3 (the family file would be models/phi3.py). ---------


def phi3_parse_config(name: str, config: dict) -> ModelArch:
    partial_rotary = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if config.get("sliding_window") or partial_rotary != 1.0:
        raise ValueError(f"{name} with a sliding window or partial rotary is not supported")
    return decoder_arch_from_hf(name, config, family="phi3")


def phi3_layer_spec(arch, fmt: str) -> LayerSpec:
    """Llama's parameters, but HF stores q|k|v and gate|up already fused."""
    qkv, o = llama.attention_linears(arch, fmt)
    gate_up, down = llama.mlp_linears(arch, fmt)
    return LayerSpec(
        (
            Norm("input_layernorm", "input_layernorm", arch.hidden_size),
            dataclasses.replace(qkv, sources=("self_attn.qkv_proj",)),
            o,
            Norm("post_attention_layernorm", "post_attention_layernorm", arch.hidden_size),
            dataclasses.replace(gate_up, sources=("mlp.gate_up_proj",)),
            down,
        )
    )


PHI3 = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    parse_config=phi3_parse_config,
    layer_spec=phi3_layer_spec,
    decoder_layer=llama.decoder_layer,  # silu(gate) * up over one fused gate|up, as HF's Phi3MLP
)


def test_a_family_in_one_file_plus_its_registration_runs_end_to_end(
    monkeypatch, tmp_path, default_model_dir
):
    monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, PHI3))  # its registration line
    spec = dict(cls="Phi3Config", tie_word_embeddings=False, rope_theta=10000.0)
    model_dir = make_tiny_model(tmp_path, spec=spec, tokenizer_dir=default_model_dir)
    assert load_hf_config(model_dir)["architectures"] == ["Phi3ForCausalLM"]
    assert "Phi3ForCausalLM" in registry.supported_architectures()

    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    ids = [(31 * i) % 40000 + 100 for i in range(40)]
    ours = model.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)
