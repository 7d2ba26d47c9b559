"""POST /v1/chat/completions through the openai client and raw HTTP."""

from __future__ import annotations

import json

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import http, parse_sse

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def chat(client: openai.OpenAI, model: str, max_tokens: int = 6, **kw):
    return client.chat.completions.create(
        model=model,
        messages=kw.pop("messages", MESSAGES),
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )


def test_stream_and_non_stream_agree(client: openai.OpenAI, model_name: str):
    full = chat(client, model_name)
    ChatCompletion.model_validate(full.model_dump())
    assert full.object == "chat.completion"
    [choice] = full.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    chunks = list(chat(client, model_name, stream=True))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]


def test_usage_matches_the_template(client: openai.OpenAI, model_name: str, engine: AsyncEngine):
    tok = engine.tokenizer
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok(text, add_special_tokens=False).input_ids)
    out = chat(client, model_name, max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 3
    assert out.usage.total_tokens == prompt_tokens + 3
    assert out.choices[0].finish_reason == "length"


def test_max_completion_tokens_and_text_parts(client: openai.OpenAI, model_name: str):
    plain = chat(client, model_name, max_tokens=4)
    parts = [
        MESSAGES[0],
        {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]},
    ]
    out = client.chat.completions.create(
        model=model_name, messages=parts, max_completion_tokens=4, temperature=0
    )
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert out.usage.completion_tokens <= 4


def test_include_usage_stream(client: openai.OpenAI, model_name: str):
    chunks = list(chat(client, model_name, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in body)
    assert sum(c.choices[0].finish_reason is not None for c in body) == 1
    full = chat(client, model_name)
    assert last.usage == full.usage


def test_n_streams_every_choice(client: openai.OpenAI, model_name: str):
    chunks = list(chat(client, model_name, max_tokens=3, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts[0] == texts[1]  # greedy


def test_logprobs(client: openai.OpenAI, model_name: str):
    out = chat(client, model_name, max_tokens=4, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy
    no_top = chat(client, model_name, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    assert chat(client, model_name, max_tokens=2).choices[0].logprobs is None


def test_sse_framing(base_url: str, model_name: str):
    reply = http(
        "POST",
        f"{base_url}/v1/chat/completions",
        json={"model": model_name, "messages": MESSAGES, "max_tokens": 3, "stream": True},
    )
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    for _, data in frames[:-1]:
        ChatCompletionChunk.model_validate(json.loads(data))
