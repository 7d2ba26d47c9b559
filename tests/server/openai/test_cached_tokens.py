"""``usage.prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served, on
completions and chat, streamed (in the usage chunk) and not."""

from __future__ import annotations

import openai

from tests.server.conftest import http

BLOCK = 16
# a prefix of 100 token ids no other test sends: 6 full blocks (96 tokens) can be cached
PREFIX = [3000 + 7 * i for i in range(100)]


def test_cached_tokens_on_completions(client: openai.OpenAI, model_name: str):
    def usage(tail: list[int], stream: bool = False):
        kw = dict(model=model_name, prompt=PREFIX + tail, max_tokens=2, temperature=0)
        if not stream:
            return client.completions.create(**kw).usage
        chunks = list(
            client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        return chunks[-1].usage

    first = usage([11, 12, 13])
    assert first.prompt_tokens_details.cached_tokens == 0  # cold
    cached = BLOCK * (len(PREFIX) // BLOCK)
    assert usage([21, 22, 23]).prompt_tokens_details.cached_tokens == cached
    assert usage([31, 32], stream=True).prompt_tokens_details.cached_tokens == cached
    # several prompts: cached tokens add up once per prompt, like prompt tokens
    out = client.completions.create(
        model=model_name, prompt=[PREFIX + [41], PREFIX + [42]], n=2, max_tokens=1
    )
    assert out.usage.prompt_tokens_details.cached_tokens == 2 * cached


def test_cached_tokens_on_chat(base_url: str, client: openai.OpenAI, model_name: str):
    system = {
        "role": "system",
        "content": "You answer questions about the cached-tokens test. " * 12,
    }
    questions = ["What is cached?", "Why is it cached?", "When is it cached?"]

    def messages(question: str) -> list[dict]:
        return [system, {"role": "user", "content": question}]

    ids = [
        http("POST", f"{base_url}/tokenize", json={"messages": messages(q)}).json()["tokens"]
        for q in questions
    ]
    common = next(i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b)
    assert common >= 4 * BLOCK
    cached = BLOCK * (common // BLOCK)
    client.chat.completions.create(model=model_name, messages=messages(questions[0]), max_tokens=1)
    second = client.chat.completions.create(
        model=model_name, messages=messages(questions[1]), max_tokens=1
    )
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages(questions[2]),
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
