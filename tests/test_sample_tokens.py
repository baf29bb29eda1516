"""The head's draw kernel (`vllm_aot::sample_tokens`) against the sampler's reference
(`runtime.sampler.draw_tokens`): the same token for every row, whatever the row's parameters,
mask, vocabulary size or neighbours."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import needs_kernels
from vllm_aot import kernels
from vllm_aot.runtime.sampler import SamplingTensors, draw_tokens, mask_words

pytestmark = [pytest.mark.unit, needs_kernels]

# (temperature, top_k, top_p, min_p) per row: plain, each truncation alone, all at once, greedy.
ROW_PARAMS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 40, 1.0, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.3, 50, 0.95, 0.01),
    (1.0, 1, 1.0, 0.0),
    (2.0, 3, 0.5, 0.0),
    (0.05, 0, 0.99, 0.0),
]


@pytest.fixture(scope="module")
def draw():
    return kernels.sample_tokens_kernel(kernels.SAMPLE_TOKENS)


def tensors(rows: int, vocab: int, g: torch.Generator, *, masked: bool, params=ROW_PARAMS):
    chosen = [params[i % len(params)] for i in range(rows)]
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*chosen, strict=True))
    mask = torch.full((rows, mask_words(vocab)), -1, dtype=torch.int32)
    if masked:  # about half of each row's vocabulary allowed, token 0 always
        mask = torch.randint(-(2**31), 2**31, mask.shape, generator=g, dtype=torch.int64)
        mask = (mask | 1).to(torch.int32)
    return SamplingTensors(
        temperature=torch.tensor(temperature),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p),
        min_p=torch.tensor(min_p),
        seeds=torch.randint(-(2**62), 2**62, (rows,), generator=g),
        positions=torch.randint(0, 4096, (rows,), generator=g),
        vocab_mask=mask,
    )


@pytest.mark.parametrize("vocab", [49152, 1003, 9])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_candidates", [64, 256])
def test_kernel_draws_the_references_tokens(draw, vocab, masked, num_candidates):
    """Rows of every parameter mix, 4 seeds each; a vocabulary with a tail past the last eight
    and one smaller than the candidates."""
    g = torch.Generator().manual_seed(vocab + masked)
    rows = 4 * len(ROW_PARAMS)
    logits = 3 * torch.randn(rows, vocab, generator=g)
    t = tensors(rows, vocab, g, masked=masked)
    candidates = min(num_candidates, vocab)
    want = draw_tokens(logits, t, False, candidates)
    got = draw(logits, t, False, candidates)
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("vocab", [49152, 37])
def test_greedy_head_takes_the_first_largest_allowed_logit(draw, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).round()  # many equal logits
    t = tensors(6, vocab, g, masked=True)
    got = draw(logits, t, True, 64)
    assert torch.equal(got, draw_tokens(logits, t, True, 64))


def test_a_row_allowing_one_token_gets_it_greedy_or_sampled(draw):
    vocab = 1003
    g = torch.Generator().manual_seed(1)
    t = tensors(len(ROW_PARAMS), vocab, g, masked=False)
    only = torch.zeros_like(t.vocab_mask)
    only[:, 999 // 32] = 1 << (999 % 32)
    t = t._replace(vocab_mask=only)
    logits = torch.randn(len(ROW_PARAMS), vocab, generator=g)
    logits[:, 999] = -30.0  # the least likely token, the only one allowed
    assert draw(logits, t, False, 64).tolist() == [999] * len(ROW_PARAMS)


def test_a_row_allowing_nothing_gets_token_zero_as_the_reference_does(draw):
    vocab = 300
    g = torch.Generator().manual_seed(4)
    t = tensors(len(ROW_PARAMS), vocab, g, masked=False)
    t = t._replace(vocab_mask=torch.zeros_like(t.vocab_mask))
    logits = torch.randn(len(ROW_PARAMS), vocab, generator=g)
    want = draw_tokens(logits, t, False, 64)
    assert draw(logits, t, False, 64).tolist() == want.tolist() == [0] * len(ROW_PARAMS)


def test_a_rows_token_does_not_depend_on_its_neighbours(draw):
    vocab = 4099
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, vocab, generator=g)
    t = tensors(16, vocab, g, masked=True)
    together = draw(logits, t, False, 256)
    alone = [draw(logits[i : i + 1], SamplingTensors(*(f[i : i + 1] for f in t)), False, 256)
             for i in range(16)]  # fmt: skip
    assert together.tolist() == torch.cat(alone).tolist()


def test_sampled_frequencies_follow_the_distribution(draw):
    """20000 positions of one seed drawing from softmax(logits / 0.8) over 6 tokens."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 20000
    t = SamplingTensors(
        temperature=torch.full((rows,), 0.8),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.full((rows,), 1234, dtype=torch.int64),
        positions=torch.arange(rows),
        vocab_mask=torch.full((rows, 1), -1, dtype=torch.int32),
    )
    tokens = draw(logits.expand(rows, -1).contiguous(), t, False, 64)
    frequencies = torch.bincount(tokens, minlength=6).float() / rows
    torch.testing.assert_close(frequencies, torch.softmax(logits / 0.8, -1), atol=0.01, rtol=0)


def test_inputs_of_the_wrong_shape_or_type_are_refused(draw):
    vocab = 100
    t = tensors(2, vocab, torch.Generator().manual_seed(3), masked=False)
    logits = torch.randn(2, vocab)
    with pytest.raises(RuntimeError, match="vocab_mask"):
        draw(logits, t._replace(vocab_mask=t.vocab_mask[:, :1]), False, 64)
    with pytest.raises(RuntimeError, match="top_k must be \\[rows\\]"):
        draw(logits, t._replace(top_k=t.top_k.int()), False, 64)
    with pytest.raises(RuntimeError, match="float32 logits"):
        draw(logits.double(), t, False, 64)
