"""A decoder converted to an embedding model (vLLM's --convert embed): prefill programs alone,
the final norm's output pooled (LAST, MEAN), against HF's last hidden states (a tiny seeded
Llama; the real SmolLM2 is slow); prompts of different lengths batched into one step, and
prompts longer than a step pooled across chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models.pooling import PooledChunks, Pooling
from vllm_aot.runtime.inputs import PrefillChunk
from vllm_aot.runtime.programs import ProgramKind

PROMPT_LENGTHS = (5, 40, 90, 150, 17)  # a 64-token budget a step: 90 and 150 in chunks
BUDGET = 64
BLOCKS_PER_PROMPT = 16  # 256 tokens of 16


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def embed_in_steps(model, token_lists, pooling: Pooling) -> torch.Tensor:
    """As vLLM's scheduler steps pooling prompts: each step takes the next chunks of the prompts
    in order until BUDGET tokens; every prompt has its own blocks."""
    pooled = [PooledChunks(pooling) for _ in token_lists]
    done = [0] * len(token_lists)
    num_steps = 0
    while any(d < len(t) for d, t in zip(done, token_lists, strict=True)):
        chunks, owners, budget = [], [], BUDGET
        for i, tokens in enumerate(token_lists):
            n = min(len(tokens) - done[i], budget)
            if n <= 0:
                continue
            blocks = range(1 + i * BLOCKS_PER_PROMPT, 1 + (i + 1) * BLOCKS_PER_PROMPT)
            chunks.append(PrefillChunk(tokens[done[i] : done[i] + n], done[i], list(blocks)))
            owners.append(i)
            done[i] += n
            budget -= n
        for i, states in zip(owners, model.prefill_states(chunks), strict=True):
            pooled[i].add(states)
        num_steps += 1
    assert num_steps >= 5  # batched and chunked: 351 tokens over steps of at most 64
    return torch.stack([p.result() for p in pooled])


def hf_states(model_dir) -> list[torch.Tensor]:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).last_hidden_state[0].double() for p in prompts()]


@pytest.fixture(params=["tiny", pytest.param("SmolLM2", marks=pytest.mark.slow)])
def model_dir(request, tiny_model_dirs, default_model_dir):
    return tiny_model_dirs("llama") if request.param == "tiny" else default_model_dir


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_pooled_embeddings_match_hf_hidden_states(model_dir, kind):
    config = tiny_config(runner="pooling", convert="embed", num_kv_blocks=5 * 16 + 1)
    model, _ = load_model(model_dir, config)
    assert {k.kind for k in model.programs} == {ProgramKind.PREFILL}  # no decode, no head
    ours = embed_in_steps(model, prompts(), Pooling(kind, normalize=True))
    states = hf_states(model_dir)
    reference = torch.stack([h[-1] if kind == "LAST" else h.mean(0) for h in states])
    cosine = F.cosine_similarity(ours.double(), reference)
    assert cosine.min() >= 0.9999, cosine
    assert ours.norm(dim=-1).tolist() == pytest.approx([1.0] * len(PROMPT_LENGTHS))
