"""Model drafts for speculative decoding (`runtime/draft.py`), against HF transformers' greedy
text: a draft model with a pool of its own that catches up on what it has not seen (eager,
float32); the gate that pauses drafts that do not pay."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers import tiny_config
from vllm_aot.loading.startup import load_model
from vllm_aot.models.tiny import make_tiny_model
from vllm_aot.runtime.draft import DraftRow, ModelDraft
from vllm_aot.runtime.inputs import PrefillChunk, RowSampling
from vllm_aot.runtime.sampler import GREEDY

K = 3
PROMPTS = [[1, 17, 923, 44, 5, 88, 300], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13] * 7]


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory, default_model_dir):
    """A tiny Llama of 4 layers: the target, unlike its 2-layer draft."""
    out = tmp_path_factory.mktemp("tiny-deep")
    return make_tiny_model(out, tokenizer_dir=default_model_dir, num_layers=4, seed=3)


def _hf_greedy(model_dir, tokens, n) -> list[int]:
    """HF's greedy continuation of `tokens`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, len(tokens) :].tolist()


def _blocks(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + num_tokens // 16 + 1))


def _prefill(model, prompt, blocks) -> int:
    """The target's prefill of `prompt`; its sampled token."""
    chunks = [prompt[i : i + 64] for i in range(0, len(prompt), 64)]
    token = None
    for i, piece in enumerate(chunks):
        out = model.prefill(
            [PrefillChunk(piece, 64 * i, blocks)], [RowSampling(GREEDY, 0, len(prompt))]
        )
        token = int(out.tokens[0])
    return token


def test_a_draft_model_catches_up_on_what_it_has_not_seen(deep_dir, tiny_model_dirs):
    """A draft model with its own pool (the 2-layer tiny Llama drafting for the 4-layer one):
    its drafts are its own greedy text after the prompt, after accepted drafts, and after a
    token that differs from its draft (the rejected position's K/V rewritten)."""
    target, _ = load_model(deep_dir, tiny_config(num_speculative_tokens=K), show_progress=False)
    draft_dir = tiny_model_dirs("llama")
    model, _ = load_model(draft_dir, tiny_config(num_speculative_tokens=K), show_progress=False)
    draft = ModelDraft(model)
    prompt = PROMPTS[1]
    blocks = _blocks(1, len(prompt) + 4 * K + 4)
    tokens = [*prompt, _prefill(target, prompt, blocks)]
    for step in range(3):
        got = draft.propose([DraftRow("r", tokens, blocks, K)])["r"]
        assert got == _hf_greedy(draft_dir, tokens, K), step
        # First all accepted, then a bonus token: two tokens the draft never fed; later the
        # first accepted, the second replaced by a correction.
        tokens += [*got, 5] if step == 0 else [got[0], (got[1] + 1) % 1000]
    draft.forget("r")
    assert draft.propose([DraftRow("r", tokens, blocks, 1)])["r"] == _hf_greedy(
        draft_dir, tokens, 1
    )


def test_the_gate_pauses_a_request_whose_drafts_keep_failing():
    """Four verify steps accepting nothing pause drafting for 16 steps, then 32 after failing
    again; drafts that pay keep it open; each request is judged alone."""
    from vllm_aot.runtime.draft import DraftGate

    gate = DraftGate(window=4, min_accepted=0.5, first_pause=16, max_pause=256)
    tokens = {"bad": [1, 2, 3], "good": [1, 2, 3]}

    def step(req_id: str) -> bool:
        """One step: the request drafts [7, 8] if allowed; 'good' gets both accepted."""
        allowed = gate.allows(req_id, tokens[req_id])
        if allowed:
            gate.drafted(req_id, len(tokens[req_id]), [7, 8])
        tokens[req_id] += [7, 8, 9] if req_id == "good" and allowed else [5]
        return allowed

    assert [step("bad") for _ in range(4)] == [True] * 4
    assert not any(step("bad") for _ in range(16))
    assert [step("bad") for _ in range(4)] == [True] * 4
    assert sum(step("bad") for _ in range(32)) == 0 and step("bad")
    assert all(step("good") for _ in range(40))
    gate.forget("bad")
    assert step("bad")


def test_a_shared_gate_starts_new_requests_where_the_last_decision_left_off():
    """A draft model's gate: after one request's drafts failed, the next request starts paused
    as long; after drafts that paid, it starts open."""
    from vllm_aot.runtime.draft import DraftGate

    gate = DraftGate(window=2, first_pause=8, is_shared=True)
    for step in range(3):  # two failing verify steps, then the decision
        assert gate.allows("a", [1] * (3 + step)) == (step < 2)
        gate.drafted("a", 3 + step, [7])
    assert not any(gate.allows("b", [1, 2]) for _ in range(8)) and gate.allows("b", [1, 2])
    tokens = [1, 2]
    for _ in range(11):  # c starts paused too, then two verify steps accept its draft
        if gate.allows("c", tokens):
            gate.drafted("c", len(tokens), [7])
        tokens = [*tokens, 7]
    assert gate.allows("d", [1, 2])
