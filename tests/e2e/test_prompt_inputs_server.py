"""Prompt logprobs and prompt embeddings through `vllm serve` on our platform (the shared tiny
server, started with --enable-prompt-embeds), driven by the openai client; what the server
returns is checked against the same tiny model run in this process (eager, float32)."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from tests.helpers import tiny_config
from vllm_aot.accuracy.teacher_forcing import our_logits
from vllm_aot.loading.startup import load_model

PROMPT = [(97 * i + 13) % 40000 + 100 for i in range(150)]  # three 64-token chunks


@pytest.fixture(scope="module")
def model(tiny_model_dirs):
    """The served model, in this process, with the server's shapes."""
    return load_model(tiny_model_dirs("llama"), tiny_config(), show_progress=False)[0]


def encoded(tensor: torch.Tensor) -> str:
    """What vLLM's completions API takes as `prompt_embeds`: base64 of a torch.save'd tensor."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def prompt_logprobs(choice) -> list:
    return choice.model_extra["prompt_logprobs"]


def test_prompt_logprobs_are_the_teacher_forced_ones(client, model):
    """150 prompt tokens (three chunks): no logprob for the first, then each prompt token's
    logprob, rank and the top 3, as the log-softmax of the teacher-forced logits."""
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    entries = prompt_logprobs(out.choices[0])
    assert len(entries) == len(PROMPT) and entries[0] is None
    expected = torch.log_softmax(our_logits(model, PROMPT)[:-1], dim=-1)
    for position, entry in enumerate(entries[1:]):
        token = PROMPT[position + 1]
        top = expected[position].topk(3)
        wanted = {token, *top.indices.tolist()}
        assert {int(t) for t in entry} == wanted
        logprob = entry[str(token)]["logprob"]
        assert logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert entry[str(token)]["rank"] >= 1
    assert out.usage.completion_tokens == 2


def test_echo_with_logprobs_scores_the_prompt(client):
    """`echo` with `logprobs` asks vLLM for prompt logprobs: prompt tokens come back scored."""
    prompt = PROMPT[:20]
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 3
    assert logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])


def test_prompt_logprobs_beyond_the_head_get_400(client):
    with pytest.raises(openai.BadRequestError, match="max allowed: 20"):
        client.completions.create(
            model="tiny", prompt=PROMPT[:8], max_tokens=2, extra_body={"prompt_logprobs": 21}
        )


def test_prompt_embeds_generate_the_token_prompt_text_in_a_shared_batch(client, model):
    """The model's own embeddings of 100 tokens, sent beside two token prompts: its greedy
    text is the token prompt's."""
    prompt = PROMPT[:100]
    embeds = model.embed(torch.tensor(prompt))

    def complete(**body):
        kwargs = dict(model="tiny", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        if "prompt_embeds" in body:
            kwargs["extra_body"] |= {"prompt_embeds": body.pop("prompt_embeds")}
            body["prompt"] = None
        return client.completions.create(**kwargs, **body).choices[0].text

    with ThreadPoolExecutor(3) as pool:
        by_tokens = pool.submit(complete, prompt=prompt)
        other = pool.submit(complete, prompt=PROMPT[50:90])
        by_embeds = pool.submit(complete, prompt_embeds=encoded(embeds))
        assert other.result()
        assert by_embeds.result() == by_tokens.result()


def test_chat_with_an_embeddings_part_generates_what_its_tokens_would(client, model):
    """A chat message of text and a `prompt_embeds` part (the model's own embeddings of 12
    tokens): vLLM renders the part as placeholder ids; with those ids replaced by the 12 tokens,
    the same prompt as token ids generates the same tokens."""
    ids = PROMPT[:12]
    content = [
        {"type": "text", "text": "Tell me"},
        {"type": "prompt_embeds", "data": encoded(model.embed(torch.tensor(ids)))},
    ]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    rendered = chat.model_extra["prompt_token_ids"]
    start = next(i for i, t in enumerate(rendered) if t >= model.arch.vocab_size)
    assert rendered[start : start + 12] == [rendered[start]] * 12
    as_tokens = rendered[:start] + ids + rendered[start + 12 :]
    out = client.completions.create(
        model="tiny",
        prompt=as_tokens,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == out.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize(
    ("embeds", "refusal"),
    [
        (torch.zeros(5, 32), "hidden_size 32 does not match the model's hidden_size 64"),
        (torch.zeros(5, 64, dtype=torch.int64), "not a floating-point type"),
    ],
    ids=["hidden_size", "dtype"],
)
def test_prompt_embeds_the_model_cannot_take_get_400(client, embeds, refusal):
    with pytest.raises(openai.BadRequestError, match=refusal):
        client.completions.create(
            model="tiny", prompt=None, max_tokens=2, extra_body={"prompt_embeds": encoded(embeds)}
        )
    out = client.completions.create(
        model="tiny", prompt=PROMPT[:8], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4


def test_bfloat16_prompt_embeds_are_cast_and_served(client, model):
    embeds = model.embed(torch.tensor(PROMPT[:30]))
    out = client.completions.create(
        model="tiny",
        prompt=None,
        max_tokens=4,
        extra_body={"prompt_embeds": encoded(embeds.bfloat16()), "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens == 30


def test_prompt_logprobs_of_prompt_embeds_get_400(client, model):
    """vLLM's completions API refuses them itself (the platform does for other front ends)."""
    embeds = model.embed(torch.tensor(PROMPT[:10]))
    with pytest.raises(openai.BadRequestError, match="not compatible with prompt embeds"):
        client.completions.create(
            model="tiny",
            prompt=None,
            max_tokens=2,
            extra_body={"prompt_embeds": encoded(embeds), "prompt_logprobs": 1},
        )
