"""Speculative decoding in the runtime: verify programs and the acceptance step (eager, fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import PrefillChunk, RowSampling, VerifyRow, prepare_sampling
from vllm_aot.runtime.sampler import GREEDY, SamplingParams, SamplingTensors
from vllm_aot.runtime.verify import DraftTensors, accept_drafts

K = 3


@pytest.fixture(scope="module")
def spec_model(tiny_model_dirs):
    model, _ = load_model(
        tiny_model_dirs("llama"), tiny_config(num_speculative_tokens=K), show_progress=False
    )
    return model


def _verify_decode(model, prompt, drafts_for, num_tokens):
    """Greedy tokens of `prompt` decoded by verify steps whose drafts `drafts_for(tokens)`
    proposes; returns (tokens, accepted drafts per step)."""
    blocks = list(range(1, 1 + (len(prompt) + num_tokens + K) // 16 + 1))
    first = model.prefill([PrefillChunk(prompt, 0, blocks)], [RowSampling(GREEDY, 0, len(prompt))])
    tokens = [*prompt, int(first.tokens[0])]
    accepted = []
    while len(tokens) < len(prompt) + num_tokens:
        drafts = drafts_for(tokens)
        row = VerifyRow([tokens[-1], *drafts], len(tokens) - 1, blocks)
        hidden, inputs = model.forward_verify([row])
        out, num_accepted = model.sample_verify(hidden, inputs, [RowSampling(GREEDY, 0, 0)])
        n = int(num_accepted[0])
        accepted.append(n)
        tokens += out.tokens[: n + 1].tolist()
    return tokens[len(prompt) : len(prompt) + num_tokens], accepted


def test_verify_steps_give_the_decode_tokens_whatever_the_drafts(spec_model):
    """Right drafts are all accepted, wrong ones rejected at once; the text is decode's."""
    prompt = [(37 * i) % 30000 + 100 for i in range(40)]
    request = GenerationRequest(prompt, max_tokens=24, ignore_eos=True)
    expected = Generator(spec_model).generate([request])[0].token_ids
    assert len(expected) == 24

    def right(tokens):
        done = len(tokens) - len(prompt)
        return expected[done : done + K]

    ours, accepted = _verify_decode(spec_model, prompt, right, 24)
    assert ours == expected
    assert accepted[: len(accepted) - 1] == [K] * (len(accepted) - 1)

    def wrong(tokens):
        done = len(tokens) - len(prompt)
        return [(t + 1) % 40000 for t in expected[done : done + K]]

    ours, accepted = _verify_decode(spec_model, prompt, wrong, 24)
    assert ours == expected
    assert set(accepted) == {0}

    ours, accepted = _verify_decode(spec_model, prompt, lambda tokens: [], 12)
    assert ours == expected[:12]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft_rank", [0, 3, None])
def test_rejection_sampling_keeps_the_target_distribution(spec_model, draft_rank):
    """The first token of a verify step, over many seeds, is distributed as the target's
    (temperature 0.7, top-k 6 of the tiny model's logits), whichever token was drafted: the
    most likely, the fourth, or one the target never samples. Chi-square, 5 degrees of freedom,
    critical value 20.5 at p = 0.001."""
    prompt = [(53 * i) % 30000 + 100 for i in range(20)]
    # The row's 256 most likely tokens as the vocabulary: the same maths, 200x less work.
    logits = spec_model.prefill_logits(PrefillChunk(prompt, 0, [1, 2]))[-1].topk(256).values
    logits = logits[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    temperature, top_k = 0.7, 6
    top = logits.topk(top_k).indices
    probs = torch.softmax(logits[top] / temperature, dim=-1)
    draft = int(top[draft_rank]) if draft_rank is not None else int(logits.argmin())
    num_samples, chunk = 6000, 500
    counts = torch.zeros(top_k)
    params = SamplingParams(temperature=temperature, top_k=top_k).normalized()
    for start in range(0, num_samples, chunk):
        rows = [RowSampling(params, seed, 20) for seed in range(start, start + chunk)]
        t: SamplingTensors = prepare_sampling(rows, chunk, logits.shape[0])
        drafts = DraftTensors(torch.full((chunk, 1), draft), torch.ones(chunk, dtype=torch.int64))
        # k = 1: row i's positions are logits rows 2i (the draft's test) and 2i + 1 (the bonus).
        both = logits[None].expand(2 * chunk, -1)
        out, _ = accept_drafts(both, t, drafts, is_greedy=False, num_logprobs=1, num_candidates=64)
        first = out.tokens.view(chunk, 2)[:, 0]
        counts += (first[:, None] == top[None, :]).sum(dim=0)
    assert counts.sum() == num_samples, "a token outside the top-k was emitted"
    assert _chi_square(counts, probs) < 20.5


def test_registry_keys_and_shows_the_speculative_configuration():
    """A configuration compiled with verify programs is served only to a command line asking
    for the same number of drafts, and `cache lookup` shows it."""
    from vllm_aot.cache.keys import cpu_target, generator_source_digest, versions
    from vllm_aot.cache.registry import CompiledConfiguration, describe_rows, select_configuration
    from vllm_aot.serve.selection import requested_shapes
    from vllm_aot.serve.settings import ShapeFlags

    def entry(k: int) -> CompiledConfiguration:
        runtime = tiny_config(num_speculative_tokens=k).shape_fields()
        return CompiledConfiguration(
            arch_digest="a",
            architecture="LlamaForCausalLM",
            runtime=runtime,
            target=cpu_target(),
            torch=versions()["torch"],
            vllm_aot=versions()["vllm_aot"],
            source=generator_source_digest(),
        )

    entries = [entry(0), entry(K)]
    spec = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    for passthrough, k in (((), 0), (spec, K)):
        requested = requested_shapes(ShapeFlags(dtype="float32"), passthrough)
        requested["kv_cache_dtype"] = "auto"
        best, _ = select_configuration(entries, requested, num_cores=1)
        assert best is not None and best.value("num_speculative_tokens") == k
    header, plain, speculative = describe_rows(entries)
    column = header.index("drafts")
    assert (plain[column], speculative[column]) == ("-", "k=3 b1,2,4")


def test_options_take_the_drafts_from_the_speculative_config(tiny_model_dirs):
    from vllm_aot.plugin.options import resolve_options

    vllm = dict(
        dtype="float32",
        quantization=None,
        runner="generate",
        convert=None,
        num_speculative_tokens=K,
        tensor_parallel_size=1,
        enable_expert_parallel=False,
        max_model_len=256,
    )
    given = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    common = dict(model=str(tiny_model_dirs("llama")), given=given, vllm=vllm)
    options = resolve_options(**common, extra={})
    assert options.runtime.num_speculative_tokens == K
    assert options.runtime.verify_batch_buckets == (1, 2, 4)
    with pytest.raises(ValueError, match="--speculative-config num_speculative_tokens asks 3"):
        resolve_options(**common, extra={"num_speculative_tokens": 2})


def test_ngram_drafter_proposes_what_followed_the_last_tokens_before():
    """The tokens after the earlier occurrence of the last n-gram, capped by max_tokens; none
    for rows whose tokens come from the host (penalties)."""

    from vllm.sampling_params import SamplingParams as VllmParams

    from vllm_aot.plugin.requests import CachedRequest
    from vllm_aot.plugin.spec_decode import NgramDrafter

    spec = SimpleNamespace(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    model_config = SimpleNamespace(max_model_len=64)
    config = SimpleNamespace(speculative_config=spec, model_config=model_config)
    drafter = NgramDrafter(config)

    def request(req_id, max_tokens, **params):
        return CachedRequest.new(
            req_id=req_id,
            prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 5, 6],
            params=VllmParams(max_tokens=max_tokens, **params),
            block_ids=[1],
            num_computed_tokens=0,
            vocab_size=100,
        )

    requests = [request("a", 16), request("b", 3), request("c", 16, repetition_penalty=1.2)]
    drafts = drafter.propose(requests)
    assert drafts.req_ids == ["a", "b", "c"]
    assert drafts.draft_token_ids == [[7, 8, 9, 10], [7, 8], []]


def test_draft_models_the_runtime_cannot_serve_are_refused_naming_what_is_supported():
    """A draft of an unsupported (or encoder) architecture, of another vocabulary, quantized,
    under tensor parallelism, or the served model itself: each refused at start with what is
    supported."""
    from vllm_aot.plugin.spec_decode import speculative_problems

    def config(vocab, arch="LlamaForCausalLM"):
        return SimpleNamespace(hf_config=SimpleNamespace(vocab_size=vocab, architectures=[arch]))

    target = SimpleNamespace(model="/target", **vars(config(100)))

    def spec(model="/draft", draft=None, quantization=None):
        return SimpleNamespace(
            method="draft_model",
            num_speculative_tokens=3,
            model=model,
            target_model_config=target,
            draft_model_config=draft or config(100),
            quantization=quantization,
        )

    assert speculative_problems(spec(), target) == []
    (itself,) = speculative_problems(spec("/target"), target)
    assert "the served model itself" in itself and "smaller model" in itself
    bert = speculative_problems(spec(draft=config(100, "BertModel")), target)
    assert len(bert) == 1 and "draft model architecture ['BertModel']" in bert[0]
    assert "LlamaForCausalLM" in bert[0]
    vocab = speculative_problems(spec(draft=config(50)), target)
    assert vocab == ["draft model vocabulary 50 (supported: the target's, 100)"]
    assert "quantized draft" in speculative_problems(spec(quantization="fp8"), target)[0]
    assert "supported: 1" in speculative_problems(spec(), target, tensor_parallel_size=2)[0]


def test_the_drafter_is_the_methods_behind_one_interface(spec_model):
    """`make_drafter`: none without speculative decoding, vLLM's n-gram matcher for `ngram`, a
    draft model's greedy passes for `draft_model`, each proposing and forgetting alike."""
    from vllm.sampling_params import SamplingParams as VllmParams

    from vllm_aot.plugin.requests import CachedRequest
    from vllm_aot.plugin.spec_decode import ModelDrafter, NgramDrafter, make_drafter

    runtime = tiny_config(num_speculative_tokens=K)
    model_config = SimpleNamespace(max_model_len=256)

    def vllm_config(method):
        spec = SimpleNamespace(
            method=method, num_speculative_tokens=K, prompt_lookup_min=2, prompt_lookup_max=3
        )
        return SimpleNamespace(speculative_config=spec, model_config=model_config)

    off = SimpleNamespace(speculative_config=None, model_config=model_config)
    assert make_drafter(off, runtime) is None
    assert isinstance(make_drafter(vllm_config("ngram"), runtime), NgramDrafter)
    drafter = make_drafter(vllm_config("draft_model"), runtime, spec_model)
    assert isinstance(drafter, ModelDrafter)
    assert drafter.max_rows == max(runtime.verify_batch_buckets)
    prompt = [(37 * i) % 30000 + 100 for i in range(20)]
    request = CachedRequest.new(
        req_id="r",
        prompt_token_ids=prompt,
        params=VllmParams(max_tokens=16, temperature=0),
        block_ids=[1, 2],
        num_computed_tokens=0,
        vocab_size=spec_model.arch.vocab_size,
    )
    request.output_token_ids.append(7)
    expected = (
        Generator(spec_model)
        .generate([GenerationRequest([*prompt, 7], max_tokens=K, ignore_eos=True)])[0]
        .token_ids
    )
    drafts = drafter.propose([request])
    assert drafts.req_ids == ["r"] and drafts.draft_token_ids == [expected]
    drafter.forget("r")
