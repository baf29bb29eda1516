"""The runtime against HF transformers, on tiny random models (eager backend, fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.runtime.generate import GenerationRequest, Generator
from vllm_aot.runtime.inputs import DecodeRow, PrefillChunk, RowSampling
from vllm_aot.runtime.kv_cache import DUMMY_BLOCK, BlockAllocator
from vllm_aot.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0).normalized()


def hf_greedy(model_dir, prompt: list[int], num_tokens: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def prompts_of_lengths(*lengths: int) -> list[list[int]]:
    return [[(97 * i + 13 * n) % 40000 + 100 for i in range(n)] for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_prefill_logits_match_hf(tiny_model_dirs, family):
    model_dir = tiny_model_dirs(family)
    model, _ = load_model(model_dir, tiny_config(), show_progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    (ids,) = prompts_of_lengths(50)
    ours = model.prefill_logits(PrefillChunk(ids, 0, [1, 2, 3, 4]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_concurrent_sequences_of_different_lengths_match_hf(tiny_model_dir):
    """Six prompts, four rows: sequences join and leave the batch; each equals HF alone."""
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    prompts = prompts_of_lengths(5, 40, 90, 17, 3, 70)
    generator = Generator(model)
    results = generator.generate([GenerationRequest(p, max_tokens=12) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(tiny_model_dir, prompt, 12)
        assert result.finish_reason == "length"
    assert generator.allocator.num_free == model.kv.num_blocks - 1, "blocks leaked"


def test_chunked_prefill_equals_one_shot_prefill(tiny_model_dir):
    """A 150-token prompt in 16-token chunks (reading earlier blocks) == one 256-token chunk."""
    (prompt,) = prompts_of_lengths(150)
    outputs = {}
    for chunk in (16, 256):
        config = tiny_config(max_num_batched_tokens=chunk, prefill_token_buckets=(chunk,))
        model, _ = load_model(tiny_model_dir, config, show_progress=False)
        (result,) = Generator(model).generate([GenerationRequest(prompt, max_tokens=8)])
        outputs[chunk] = result
        executed = {k.name: n for k, n in model.num_executions.items() if n}
        assert executed[f"prefill_t{chunk}_c0"] == 1  # the first chunk reads no cache
        assert executed.get(f"prefill_t{chunk}_c256", 0) == (9 if chunk == 16 else 0)
    assert outputs[16].token_ids == outputs[256].token_ids
    assert outputs[16].logprobs == pytest.approx(outputs[256].logprobs, abs=1e-4)


def test_a_prompt_just_past_a_bucket_runs_as_pieces_with_the_logits_of_one_call(tiny_model_dir):
    """130 tokens with buckets of 32, 128 and 256: a 128-token program, then a 32-token one for
    the last 2 (reading the first 128 from the cache), not 126 tokens of padding."""
    (prompt,) = prompts_of_lengths(130)
    logits, prefills = {}, {}
    for buckets in ((32, 128, 256), (256,)):
        config = tiny_config(max_num_batched_tokens=256, prefill_token_buckets=buckets)
        model, _ = load_model(tiny_model_dir, config, show_progress=False)
        logits[buckets] = model.prefill_logits(PrefillChunk(prompt, 0, list(range(1, 10))))
        prefills[buckets] = {
            k.name: n for k, n in model.num_executions.items() if n and k.name.startswith("pre")
        }
    assert prefills == {
        (32, 128, 256): {"prefill_t128_c0": 1, "prefill_t32_c256": 1},
        (256,): {"prefill_t256_c0": 1},
    }
    torch.testing.assert_close(logits[(32, 128, 256)], logits[(256,)], atol=1e-4, rtol=1e-4)


def test_several_prompts_packed_in_one_prefill_match_separate_runs(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    prompts = prompts_of_lengths(9, 20, 30)
    allocator = BlockAllocator(model.kv.num_blocks)
    chunks = [PrefillChunk(p, 0, allocator.allocate(2)) for p in prompts]
    rows = [RowSampling(GREEDY, 0, len(p)) for p in prompts]
    packed = model.prefill(chunks, rows)
    for i, chunk in enumerate(chunks):
        alone = model.prefill([chunk], [rows[i]])
        torch.testing.assert_close(packed.logits[i], alone.logits[0], atol=1e-4, rtol=1e-4)


def _snapshot(model):
    return [k.clone() for k in model.kv.k] + [v.clone() for v in model.kv.v]


def _changed_blocks(model, before) -> set[int]:
    after = [*model.kv.k, *model.kv.v]
    changed = set()
    for old, new in zip(before, after, strict=True):
        diff = (old != new).flatten(1).any(dim=1)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    return changed


def test_padding_never_touches_live_blocks(tiny_model_dir):
    """3 decode rows padded to a bucket of 4 and a 20-token prefill padded to 32 write only
    their own slots and the dummy block."""
    model, _ = load_model(tiny_model_dir, tiny_config(), show_progress=False)
    allocator = BlockAllocator(model.kv.num_blocks)
    live = [allocator.allocate(4) for _ in range(4)]
    prompts = prompts_of_lengths(20, 20, 20, 20)
    for blocks, prompt in zip(live, prompts, strict=True):
        model.prefill([PrefillChunk(prompt, 0, blocks)], [RowSampling(GREEDY, 0, 20)])

    before = _snapshot(model)
    rows = [DecodeRow(5, 20, blocks) for blocks in live[:3]]
    model.decode(rows, [RowSampling(GREEDY, 0, 21)] * 3)
    # Position 20 lives in each row's second block; nothing else but the dummy may change.
    assert _changed_blocks(model, before) - {DUMMY_BLOCK} == {blocks[1] for blocks in live[:3]}

    before = _snapshot(model)
    model.prefill([PrefillChunk(prompts[3], 20, live[3])], [RowSampling(GREEDY, 0, 40)])
    assert _changed_blocks(model, before) - {DUMMY_BLOCK} == {live[3][1], live[3][2]}
