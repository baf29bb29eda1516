"""The GGUF K-quant formats (`q4_k`, `q5_k`, `q6_k`; `models/formats_k.py`, `kernels/quant_k.h`):
the pure-torch reference against the `gguf` package's dequantisation, the kernels against the
reference on every row path, and a tiny model whose linears are Q4_K served from its file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gguf_files import GgmlType, transformers_weights, write_dense_twin, write_gguf
from tests.helpers import needs_kernels, tiny_config
from vllm_aot import kernels
from vllm_aot.loading.startup import load_model
from vllm_aot.models.formats import WEIGHT_FORMATS
from vllm_aot.models.formats_k import BLOCK_BYTES
from vllm_aot.models.gguf import GgufFile
from vllm_aot.models.tiny import make_tiny_model
from vllm_aot.runtime.generate import GenerationRequest, Generator

TYPES = {"q4_k": GgmlType.Q4_K, "q5_k": GgmlType.Q5_K, "q6_k": GgmlType.Q6_K}
ROWS = (1, 2, 3, 5, 8, 9, 33)  # direct kernel up to 8 (`kernels/quant.h`), then the GEMM
SHAPES = ((7, 256), (33, 2048))  # out odd (tile tails), one and eight super-blocks a row


def random_blocks(fmt: str, rows: int, supers: int, seed: int = 0) -> np.ndarray:
    """Random bytes, each super-block's fp16 d (and dmin) finite."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, supers, BLOCK_BYTES[fmt]), dtype=np.uint8)
    halves = (g.standard_normal((rows, supers, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if fmt == "q6_k":
        raw[..., 208:210] = halves[..., :2]
    else:
        raw[..., 0:4] = halves
    return raw.reshape(rows, -1)


@pytest.mark.unit
@pytest.mark.parametrize("fmt", TYPES)
def test_reference_dequantises_as_the_gguf_package(fmt):
    raw = random_blocks(fmt, 5, 3)
    want = gguf.quants.dequantize(raw, TYPES[fmt])
    got = WEIGHT_FORMATS[fmt].dequantize(torch.from_numpy(raw))
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


@pytest.mark.unit
@pytest.mark.parametrize("fmt", TYPES)
def test_prepare_round_trips_within_a_quantisation_step(fmt):
    weight = torch.randn(9, 512)
    stored = WEIGHT_FORMATS[fmt].prepare(weight)
    assert [t.shape for t in stored] == [(9, 2 * BLOCK_BYTES[fmt])]
    error = (WEIGHT_FORMATS[fmt].dequantize(*stored) - weight).abs().amax()
    levels = {"q4_k": 15, "q5_k": 31, "q6_k": 63}[fmt]
    assert error <= 1.2 * (weight.amax() - weight.amin()) / levels
    with pytest.raises(ValueError, match="in_features divisible by 256"):
        WEIGHT_FORMATS[fmt].prepare(torch.randn(4, 96))


@pytest.mark.unit
@needs_kernels
@pytest.mark.parametrize("fmt", TYPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_kernel_matches_the_reference_on_random_blocks(fmt, dtype):
    """Float32 arithmetic on activations as they are: the reference to float32 rounding
    (bfloat16 outputs add their own rounding), a row's result the same alone."""
    kernels.load()
    op = getattr(torch.ops.vllm_aot, f"linear_{fmt}")
    for out_features, in_features in SHAPES:
        blocks = torch.from_numpy(random_blocks(fmt, out_features, in_features // 256))
        weight = WEIGHT_FORMATS[fmt].dequantize(blocks)
        g = torch.Generator().manual_seed(in_features)
        for rows in ROWS:
            x = (torch.randn(rows, in_features, generator=g) * torch.rand(in_features)).to(dtype)
            got = op(x, blocks)
            assert got.dtype == dtype and got.shape == (rows, out_features)
            want = F.linear(x.float(), weight)
            gemm_bf16 = rows > 8 and dtype == torch.bfloat16  # bfloat16 GEMM where native
            magnitude = x.float().abs() @ weight.abs().T
            tolerance = (2.0**-8 if gemm_bf16 else 1e-5) * magnitude
            tolerance += (2.0**-8 if dtype == torch.bfloat16 else 0.0) * want.abs()
            error = (got.float() - want).abs()
            assert (error <= tolerance).all(), f"{fmt} {rows}x{in_features}"
            if rows <= 8:
                assert torch.equal(op(x[rows // 2 :][:1], blocks)[0], got[rows // 2])


@pytest.mark.unit
@needs_kernels
def test_the_kernel_refuses_blocks_that_are_not_whole_super_blocks():
    kernels.load()
    with pytest.raises(RuntimeError, match=r"linear_q4_k: blocks uint8 \[n, k / 256 \* 144\]"):
        torch.ops.vllm_aot.linear_q4_k(torch.randn(1, 256), torch.zeros(3, 100, dtype=torch.uint8))


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory, default_model_dir):
    """(HF directory, GGUF directory) of a tiny Llama with hidden size 256 (whole super-blocks),
    its layer linears Q4_K."""
    hf_dir = make_tiny_model(
        tmp_path_factory.mktemp("tiny-256"), tokenizer_dir=default_model_dir, hidden_size=256
    )
    out = tmp_path_factory.mktemp("gguf-q4_k")
    return hf_dir, write_gguf(hf_dir, out, family="llama", linear_type=GgmlType.Q4_K)


def test_q4_k_planes_are_the_file_s_blocks_dequantised_as_transformers_reads_them(q4_k_model):
    hf_dir, model_dir = q4_k_model
    expected = transformers_weights(model_dir, hf_dir, "llama")
    file = GgufFile(model_dir / "model.gguf")
    (blocks,) = file.weight("model.layers.0.mlp.down_proj.weight").tensors
    start = file.data.ctypes.data  # read in place: a view of the mapped file
    assert start <= blocks.data_ptr() < start + file.data.nbytes
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        got = WEIGHT_FORMATS["q4_k"].dequantize(*file.weight(name).tensors)
        torch.testing.assert_close(got, expected[name], rtol=0, atol=0)


def greedy(source, config, prompt):
    model, _ = load_model(source, config)
    request = GenerationRequest(list(prompt), max_tokens=6, ignore_eos=True)
    (result,) = Generator(model).generate([request])
    return model.config.weight_formats, result.token_ids


def test_a_q4_k_model_serves_as_the_dense_model_of_the_same_weights(q4_k_model, tmp_path):
    hf_dir, model_dir = q4_k_model
    weights = transformers_weights(model_dir, hf_dir, "llama")
    dense_dir = write_dense_twin(model_dir, weights, tmp_path / "dense")
    prompt = [1, 450, 4996, 17354, 1701]
    formats, tokens = greedy(model_dir, tiny_config(quantization="gguf"), prompt)
    assert dict(formats)["*"] == "q4_k"
    assert greedy(dense_dir, tiny_config(), prompt) == ((), tokens)
