"""On-device sampling: what a request's sampling parameters do to the tokens it gets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk, RowSampling, prepare_sampling
from vllm_aot.runtime.sampler import GREEDY, SamplingParams, all_greedy, sample_rows

pytestmark = pytest.mark.unit

VOCAB = 1000
NUM_LOGPROBS = 5


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds, mask=None):
    rows = [
        RowSampling(p.normalized(), seed, 7, None if mask is None else mask[i])
        for i, (p, seed) in enumerate(zip(params, seeds, strict=True))
    ]
    tensors = prepare_sampling(rows, len(rows), VOCAB)
    is_greedy = all_greedy(r.params for r in rows)
    return sample_rows(
        logits, tensors, is_greedy=is_greedy, num_logprobs=NUM_LOGPROBS, num_candidates=64
    )


def allow_only(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """A packed vocabulary mask [ceil(vocab / 32)] int32 allowing only `tokens`."""
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    for token in tokens:
        word, bit = divmod(token, 32)
        mask[word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    return mask


@pytest.fixture
def logits():
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_temperature_zero_is_normalised_to_top_k_one_without_mutating():
    params = SamplingParams(temperature=0.0, top_p=0.5, seed=3)
    normal = params.normalized()
    assert (normal.top_k, normal.temperature, normal.top_p) == (1, 1.0, 1.0)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.top_k = 1  # type: ignore[misc]


def test_top_k_one_equals_greedy(logits):
    hot = SamplingParams(temperature=5.0, top_k=1)
    for seed in range(20):
        assert sample(logits, [hot], [seed]).tokens.item() == logits.argmax().item()


def test_seeded_sampling_is_reproducible_and_seeds_differ(logits):
    params = SamplingParams(temperature=1.5)
    first = [sample(logits, [params], [s]).tokens.item() for s in range(30)]
    again = [sample(logits, [params], [s]).tokens.item() for s in range(30)]
    assert first == again
    assert len(set(first)) > 5, "different seeds should explore the distribution"


def test_top_k_keeps_only_the_k_most_likely(logits):
    top3 = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=10.0, top_k=3)
    drawn = {sample(logits, [params], [s]).tokens.item() for s in range(60)}
    assert drawn <= top3 and len(drawn) > 1


def test_top_p_and_min_p_cut_the_tail(logits):
    probs = torch.softmax(logits[0], dim=-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    drawn = {sample(logits, [SamplingParams(top_p=0.5)], [s]).tokens.item() for s in range(60)}
    assert drawn <= nucleus
    floor = 0.3 * probs.max()
    kept = set(torch.nonzero(probs >= floor).flatten().tolist())
    drawn = {sample(logits, [SamplingParams(min_p=0.3)], [s]).tokens.item() for s in range(60)}
    assert drawn <= kept


def test_vocab_mask_restricts_choices(logits):
    allowed = [11, 500, 999]
    mask = allow_only(allowed, VOCAB)[None]
    greedy = sample(logits, [SamplingParams(temperature=0)], [0], mask)
    assert greedy.tokens.item() == max(allowed, key=lambda t: logits[0, t].item())
    drawn = {
        sample(logits, [SamplingParams(temperature=3.0)], [s], mask).tokens.item()
        for s in range(40)
    }
    assert drawn <= set(allowed)


def test_logprobs_are_the_raw_log_softmax(logits):
    out = sample(logits, [SamplingParams(temperature=2.0)], [1])
    logprobs = torch.log_softmax(logits[0], dim=-1)
    token = out.tokens.item()
    assert out.token_logprobs.item() == pytest.approx(logprobs[token].item(), abs=1e-5)
    assert out.top_ids[0].tolist() == logprobs.topk(NUM_LOGPROBS).indices.tolist()


def test_seeded_requests_do_not_depend_on_their_batch(tiny_model_dir):
    """The same seeded request gives the same tokens alone and beside other requests."""
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    seeded = GenerationRequest([100, 200, 300], 10, SamplingParams(temperature=0.9, seed=42))
    others = [GenerationRequest([5] * n, 10, SamplingParams(temperature=1.0)) for n in (4, 30)]
    (alone,) = Generator(model).generate([seeded])
    batched = Generator(model).generate([others[0], seeded, others[1]])
    assert batched[1].token_ids == alone.token_ids


def test_requested_logprobs_come_back_per_token(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    request = GenerationRequest([100, 200], 5, SamplingParams(temperature=0, num_logprobs=3))
    (result,) = Generator(model).generate([request])
    assert len(result.top_logprobs) == len(result.token_ids) == 5
    for token, logprob, top in zip(
        result.token_ids, result.logprobs, result.top_logprobs, strict=True
    ):
        assert len(top) == 3
        assert max(top, key=top.get) == token  # greedy picks the most likely
        assert top[token] == pytest.approx(logprob)


@pytest.mark.parametrize("kinds", ["greedy", "greedy+seeded"])
def test_head_logprob_and_rank_equal_a_host_log_softmax(tiny_model_dir, kinds):
    """The head's sampled-token logprob and 1-based rank are those of the raw logits'
    log-softmax, in the greedy and the sampling head, with a vocabulary mask on some rows."""
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    vocab = model.arch.vocab_size
    allowed = list(range(3, vocab, 97))
    mask = allow_only(allowed, vocab)
    rows = [RowSampling(GREEDY, 0, 8, mask), RowSampling(GREEDY, 0, 8)]
    if kinds == "greedy+seeded":
        seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=5).normalized()
        rows += [RowSampling(seeded, 5, 8, mask), RowSampling(seeded, 6, 8)]
    chunks = [PrefillChunk([100 + 7 * i + j for j in range(8)], 0, [i + 1]) for i in range(4)]
    out = model.prefill(chunks[: len(rows)], rows)
    executed = {k.kind.value for k, n in model.num_executions.items() if n and not k.is_layer}
    assert executed == {"greedy" if kinds == "greedy" else "sample"}
    logprobs = torch.log_softmax(out.logits, dim=-1)
    for i, token in enumerate(out.tokens.tolist()):
        expected = logprobs[i, token]
        assert out.token_logprobs[i].item() == pytest.approx(expected.item(), abs=1e-6)
        assert out.token_ranks[i].item() == int((logprobs[i] >= expected).sum())
        if rows[i].vocab_mask is not None:
            assert token in allowed
    assert out.token_ranks[0].item() > 1, "the mask keeps the model's favourite out"
    assert out.token_ranks[1].item() == 1, "greedy without a mask takes the favourite"


def test_host_processed_rows_report_raw_logprobs(logits):
    """A biased row samples the biased token; its logprob and rank are of the raw logits."""
    from vllm import SamplingParams as VllmSamplingParams

    from vllm_aot.plugin.logits import process_logits, resample
    from vllm_aot.plugin.requests import CachedRequest

    params = VllmSamplingParams(temperature=0, logprobs=2, logit_bias={7: 100.0})
    request = CachedRequest.new(
        req_id="r",
        prompt_token_ids=[1, 2],
        params=params,
        block_ids=[1],
        num_computed_tokens=0,
        vocab_size=VOCAB,
    )
    sampling = RowSampling(request.sampling, request.seed, 2)
    processed = process_logits(logits[0], request)
    out = resample(logits[:1], processed[None], [sampling], tiny_config())
    logprobs = torch.log_softmax(logits[0], dim=-1)
    assert out.tokens.item() == 7
    assert out.token_logprobs.item() == pytest.approx(logprobs[7].item(), abs=1e-6)
    assert out.token_ranks.item() == int((logprobs >= logprobs[7]).sum()) > 1
    assert out.top_ids[0, 0].item() == logits[0].argmax().item()


def _host_request(req_id: str, outputs: list[int], **params):
    from vllm import SamplingParams as VllmSamplingParams

    from vllm_aot.plugin.requests import CachedRequest

    request = CachedRequest.new(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3, 2],
        params=VllmSamplingParams(max_tokens=64, **params),
        block_ids=[1],
        num_computed_tokens=0,
        vocab_size=VOCAB,
    )
    request.output_token_ids.extend(outputs)
    return request


def test_host_processed_rows_drawn_together_equal_each_drawn_alone():
    """The runner draws a step's host-processed rows in one call; each row's token, logprob and
    rank are what it gets drawn alone (its seed and position, not its neighbours, decide)."""
    from vllm_aot.plugin.logits import process_logits, resample

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    requests = [
        _host_request("a", [5, 9, 9], temperature=1.0, repetition_penalty=1.3, seed=3),
        _host_request("b", [7], temperature=0.0, presence_penalty=1.5, logprobs=2),
        _host_request("c", [], temperature=0.8, top_p=0.9, logit_bias={11: 5.0}, seed=4),
        _host_request("d", [4, 4], temperature=1.0, frequency_penalty=0.7, min_tokens=5),
    ]
    sampling = [RowSampling(r.sampling, r.seed, 9 + i) for i, r in enumerate(requests)]
    processed = torch.stack([process_logits(logits[i], r) for i, r in enumerate(requests)])
    together = resample(logits, processed, sampling, tiny_config())
    for i in range(len(requests)):
        alone = resample(
            logits[i : i + 1], processed[i : i + 1], sampling[i : i + 1], tiny_config()
        )
        for field, value in zip(together._fields, together, strict=True):
            assert torch.equal(value[i], getattr(alone, field)[0]), (i, field)


def test_frequency_and_presence_penalties_move_only_generated_tokens():
    """vLLM's penalties: logits -= frequency * count + presence * (count > 0), per generated
    token; the prompt's tokens and the rest of the vocabulary keep their logits."""
    from vllm_aot.plugin.logits import process_logits

    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    outputs = [5, 9, 9, 9, 400]
    request = _host_request("p", outputs, frequency_penalty=0.5, presence_penalty=0.25)
    counts = torch.bincount(torch.tensor(outputs), minlength=VOCAB).float()
    expected = logits - 0.5 * counts - 0.25 * (counts > 0).float()
    assert torch.allclose(process_logits(logits, request), expected, atol=1e-6)


def test_bans_are_mask_bits_and_draw_what_banned_logits_would():
    """min_tokens' stop tokens, bad words whose prefix was just generated and tokens outside
    allowed_token_ids are bits cleared in the row's vocabulary mask; drawing under that mask
    gives the token, logprob and rank that drawing from logits with the bans at -inf gives."""
    from vllm_aot.plugin.logits import vocab_mask
    from vllm_aot.runtime.sampler import unpack_vocab_mask

    request = _host_request(
        "m", [5, 6], temperature=1.0, seed=3, min_tokens=4, bad_words=[], stop_token_ids=[7, 40]
    )
    request.params._bad_words_token_ids = [[6, 9], [11], [5, 12]]  # vLLM tokenises the words
    allowed = unpack_vocab_mask(vocab_mask(request, None, VOCAB)[None], VOCAB)[0]
    banned = {7, 40, 9, 11}  # the stop tokens, [6, 9] after 6, [11]; not [5, 12]
    assert set(torch.nonzero(~allowed).flatten().tolist()) == banned

    grammar = allow_only([3, 7, 9, 12, 500], VOCAB)  # a structured output's mask, ANDed
    both = unpack_vocab_mask(vocab_mask(request, grammar, VOCAB)[None], VOCAB)[0]
    assert torch.nonzero(both).flatten().tolist() == [3, 12, 500]

    only = _host_request("a", [], temperature=1.0, allowed_token_ids=[2, 31, 32, 999])
    kept = unpack_vocab_mask(vocab_mask(only, None, VOCAB)[None], VOCAB)[0]
    assert torch.nonzero(kept).flatten().tolist() == [2, 31, 32, 999]
    assert vocab_mask(_host_request("p", [1], presence_penalty=1.0), grammar, VOCAB) is grammar
    reached = _host_request("r", [5, 6, 8], temperature=1.0, min_tokens=2, stop_token_ids=[7])
    assert vocab_mask(reached, grammar, VOCAB) is grammar  # nothing out this step
    assert vocab_mask(reached, None, VOCAB) is None

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    params = SamplingParams(temperature=1.0).normalized()
    masked = sample(logits, [params], [3], mask=vocab_mask(request, None, VOCAB)[None])
    banned_logits = logits.clone()
    banned_logits[0, sorted(banned)] = float("-inf")
    tensors = prepare_sampling([RowSampling(params, 3, 7)], 1, VOCAB)
    reference = sample_rows(
        logits, tensors, is_greedy=False, num_logprobs=NUM_LOGPROBS, num_candidates=64,
        processed=banned_logits,
    )  # fmt: skip
    assert masked.tokens.item() == reference.tokens.item()
    assert torch.equal(masked.token_logprobs, reference.token_logprobs)
