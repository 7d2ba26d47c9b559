"""POST /v1/completions through the openai client and raw HTTP."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import http, parse_sse

PROMPT = "The capital of France is"
OTHER = "Once upon a time"


def greedy(client: openai.OpenAI, model: str, prompt: object, max_tokens: int = 8, **kw):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def test_stream_and_non_stream_agree(client: openai.OpenAI, model_name: str):
    full = greedy(client, model_name, PROMPT)
    Completion.model_validate(full.model_dump())
    assert full.object == "text_completion"
    assert full.model == model_name
    chunks = list(greedy(client, model_name, PROMPT, stream=True))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_usage_and_length(client: openai.OpenAI, model_name: str, engine: AsyncEngine):
    out = greedy(client, model_name, PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(engine.tokenize(PROMPT))
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_stop_string_ends_and_is_excluded(client: openai.OpenAI, model_name: str):
    text = greedy(client, model_name, PROMPT, max_tokens=10).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = greedy(client, model_name, PROMPT, max_tokens=10, stop=[stop, "never-seen"])
    [choice] = out.choices
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    streamed = greedy(client, model_name, PROMPT, max_tokens=10, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_several_prompts_and_n_indices(client: openai.OpenAI, model_name: str):
    """index = prompt_index * n + sample_index: greedy samples of one prompt agree."""
    alone = [greedy(client, model_name, p, max_tokens=4).choices[0].text for p in (PROMPT, OTHER)]
    out = greedy(client, model_name, [PROMPT, OTHER], max_tokens=4, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [alone[0], alone[0], alone[1], alone[1]]
    single_usage = greedy(client, model_name, PROMPT, max_tokens=4).usage
    other_usage = greedy(client, model_name, OTHER, max_tokens=4).usage
    # prompt tokens count once per prompt, completion tokens once per choice
    assert out.usage.prompt_tokens == single_usage.prompt_tokens + other_usage.prompt_tokens
    assert out.usage.completion_tokens == sum(
        u.completion_tokens * 2 for u in (single_usage, other_usage)
    )
    streamed = list(greedy(client, model_name, [PROMPT, OTHER], max_tokens=4, n=2, stream=True))
    texts = {i: "" for i in range(4)}
    finished = {i: 0 for i in range(4)}
    for chunk in streamed:
        [c] = chunk.choices
        texts[c.index] += c.text
        finished[c.index] += c.finish_reason is not None
    assert list(texts.values()) == [alone[0], alone[0], alone[1], alone[1]]
    assert list(finished.values()) == [1, 1, 1, 1]


def test_token_id_prompts(client: openai.OpenAI, model_name: str, engine: AsyncEngine):
    ids = engine.tokenize(PROMPT)
    text = greedy(client, model_name, PROMPT, max_tokens=4).choices[0].text
    assert greedy(client, model_name, ids, max_tokens=4).choices[0].text == text
    out = greedy(client, model_name, [ids, engine.tokenize(OTHER)], max_tokens=4)
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) + len(engine.tokenize(OTHER))


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model_name: str):
    def sample(seed: int, n: int = 1) -> list[str]:
        out = client.completions.create(
            model=model_name,
            prompt=OTHER,
            max_tokens=6,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in out.choices]

    first = sample(1234)
    assert sample(1234) == first
    # sample i of n runs with seed + i
    pair = sample(1234, n=2)
    assert pair == first + sample(1235)


def test_echo(client: openai.OpenAI, model_name: str):
    plain = greedy(client, model_name, PROMPT, max_tokens=4).choices[0].text
    echoed = greedy(client, model_name, PROMPT, max_tokens=4, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    chunks = list(greedy(client, model_name, PROMPT, max_tokens=4, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_logprobs(client: openai.OpenAI, model_name: str):
    out = greedy(client, model_name, PROMPT, max_tokens=5, logprobs=2)
    [choice] = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == out.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 1 <= len(top) <= 3  # the sampled token plus up to 2 alternatives
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the likeliest
    chunks = list(greedy(client, model_name, PROMPT, max_tokens=5, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert tokens == lp.tokens
    assert offsets == lp.text_offset
    assert greedy(client, model_name, PROMPT, max_tokens=2).choices[0].logprobs is None


def test_include_usage_stream(client: openai.OpenAI, model_name: str):
    chunks = list(
        greedy(
            client,
            model_name,
            PROMPT,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == []
    assert last.usage.completion_tokens == 4 or body[-1].choices[0].finish_reason == "stop"
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in body)


def test_sse_framing(base_url: str, model_name: str):
    reply = http(
        "POST",
        f"{base_url}/v1/completions",
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True},
    )
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    assert all(event is None for event, _ in frames)
    chunks = [json.loads(data) for _, data in frames[:-1]]
    for chunk in chunks[:-1]:  # the SDK's type wants a finish_reason: only the last has one
        assert chunk["object"] == "text_completion"
        assert chunk["choices"][0]["finish_reason"] is None
    Completion.model_validate(chunks[-1])
    assert "usage" not in json.loads(frames[0][1])  # only with include_usage


def test_penalties_reach_the_engine(client: openai.OpenAI, model_name: str):
    """A prompt the model would keep repeating: the penalties change the greedy continuation,
    and the penalised text repeats fewer tokens."""
    prompt = "one one one one one one one one"
    kw = dict(max_tokens=12, extra_body={"ignore_eos": True}, logprobs=0)
    plain = greedy(client, model_name, prompt, **kw)
    penalised = greedy(
        client,
        model_name,
        prompt,
        frequency_penalty=1.0,
        presence_penalty=1.0,
        **{**kw, "extra_body": {"ignore_eos": True, "repetition_penalty": 1.3}},
    )
    Completion.model_validate(penalised.model_dump())
    plain_tokens = plain.choices[0].logprobs.tokens
    penalised_tokens = penalised.choices[0].logprobs.tokens
    assert penalised_tokens != plain_tokens
    assert len(set(penalised_tokens)) > len(set(plain_tokens))


def test_logit_bias_forces_a_token(client: openai.OpenAI, model_name: str, engine: AsyncEngine):
    token = engine.tokenize(" Paris")[-1]
    out = greedy(
        client,
        model_name,
        OTHER,
        max_tokens=4,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == engine.engine.tokenizer.decode([token] * 4)


def test_stop_token_ids_and_special_tokens(
    client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    """vLLM's extras: a forced token listed in stop_token_ids ends the choice at once; a forced
    special token shows in the text only with skip_special_tokens false."""
    tokenizer = engine.engine.tokenizer
    word = engine.tokenize(" Paris")[-1]
    stopped = greedy(
        client,
        model_name,
        OTHER,
        max_tokens=6,
        logit_bias={str(word): 100},
        extra_body={"stop_token_ids": [word]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    kw = dict(max_tokens=2, logit_bias={str(special): 100})
    hidden = greedy(client, model_name, OTHER, **kw, extra_body={"ignore_eos": True})
    shown = greedy(
        client,
        model_name,
        OTHER,
        **kw,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert hidden.choices[0].text == ""
    assert shown.choices[0].text == "<|im_end|><|im_end|>"
