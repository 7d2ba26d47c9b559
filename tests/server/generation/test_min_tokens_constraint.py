"""``min_tokens`` beside a constraint that must end sooner (issue 31, item 8): the constraint
wins, the reply is the constrained answer with ``finish_reason: stop``, never a 500 that
blames the model. ``pool_clean`` checks that no KV block leaks."""

from __future__ import annotations

import json

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import http, parse_sse


def eos_bias(engine: AsyncEngine) -> dict[str, float]:
    """A logit_bias that makes every EOS token the likeliest by far."""
    return {str(t): 100.0 for t in engine.engine.eos_token_ids}


@pytest.mark.parametrize("temperature", [0, 1])
def test_guided_choice_with_min_tokens_is_the_answer(
    base_url: str, engine: AsyncEngine, temperature: int
):
    body = {
        "prompt": "Is Paris in France? Answer yes or no:",
        "max_tokens": 8,
        "min_tokens": 3,
        "guided_choice": ["yes", "no"],
        "temperature": temperature,
        "n": 4,
        "seed": 7,
    }
    reply = http("POST", f"{base_url}/v1/completions", json=body)
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        assert choice["text"] in ("yes", "no")
        assert choice["finish_reason"] == "stop"


def test_chat_json_schema_enum_with_min_tokens_streams_the_answer(
    base_url: str, engine: AsyncEngine
):
    schema = {"enum": ["ok"]}
    body = {
        "messages": [{"role": "user", "content": "Say ok."}],
        "max_tokens": 20,
        "min_tokens": 10,
        "stream": True,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    reply = http("POST", f"{base_url}/v1/chat/completions", json=body)
    assert reply.status == 200, reply.body
    frames = [data for _, data in parse_sse(reply.body)]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert not any("error" in c for c in chunks), chunks
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert json.loads(text) == "ok"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_min_tokens_still_holds_eos_back_beside_a_grammar_that_may_go_on(
    base_url: str, engine: AsyncEngine
):
    body = {
        "prompt": "Count:",
        "max_tokens": 12,
        "min_tokens": 4,
        "guided_regex": "[0-9]{1,40}",
        "temperature": 0,
        "logit_bias": eos_bias(engine),
    }
    reply = http("POST", f"{base_url}/v1/completions", json=body)
    assert reply.status == 200, reply.body
    out = reply.json()
    [choice] = out["choices"]
    assert choice["finish_reason"] == "stop" and choice["text"].isdigit()
    assert out["usage"]["completion_tokens"] == 5  # held back for 4 tokens, then EOS at once
