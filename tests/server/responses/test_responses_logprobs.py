"""Responses API output-text logprobs (``include: ["message.output_text.logprobs"]``), and the
request fields OpenAI documents that this server refuses, accepts as hints, or implements."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import assert_error, http, parse_sse

INCLUDE = ["message.output_text.logprobs"]
PROMPT = "Name three colors."
TOP = 3


def _chat_entries(client: openai.OpenAI, model: str, max_tokens: int, top: int) -> list[dict]:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=top,
    )
    return [e.model_dump() for e in out.choices[0].logprobs.content]


def _assert_same_entries(got: list[dict], expected: list[dict]) -> None:
    """Same tokens (text and bytes) and logprobs to 1e-4, alternatives too: the second request
    hits the first's prefix, so its rows go through the fp32 projections at another row count,
    where the kernel chosen at load (engine/platform/cpu/linears.py) may sum in another order
    (1.3e-5 apart on one alternative's logprob in one CI run)."""
    assert [e["token"] for e in got] == [e["token"] for e in expected]
    for g, e in zip(got, expected):
        assert g["bytes"] == e["bytes"]
        assert g["logprob"] == pytest.approx(e["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in e["top_logprobs"]]
        for gt, et in zip(g["top_logprobs"], e["top_logprobs"]):
            assert gt["bytes"] == et["bytes"]
            assert gt["logprob"] == pytest.approx(et["logprob"], abs=1e-4)


def test_logprobs_equal_chat_logprobs(client: openai.OpenAI, model_name: str):
    expected = _chat_entries(client, model_name, 8, TOP)
    made = client.responses.create(
        model=model_name,
        input=PROMPT,
        max_output_tokens=8,
        temperature=0,
        include=INCLUDE,
        top_logprobs=TOP,
    )
    assert made.top_logprobs == TOP
    [part] = made.output[0].content
    got = [e.model_dump() for e in part.logprobs]
    assert len(got) == made.usage.output_tokens == 8
    assert all(len(e["top_logprobs"]) == TOP for e in got)
    _assert_same_entries(got, expected)
    assert "".join(e["token"] for e in got).startswith(part.text)  # the tokens spell the text
    # stored as returned
    assert client.responses.retrieve(made.id).output[0].content[0].model_dump() == part.model_dump()


def test_logprobs_without_alternatives(client: openai.OpenAI, model_name: str):
    expected = _chat_entries(client, model_name, 3, 0)
    made = client.responses.create(
        model=model_name, input=PROMPT, max_output_tokens=3, temperature=0, include=INCLUDE
    )
    got = [e.model_dump() for e in made.output[0].content[0].logprobs]
    assert all(e["top_logprobs"] == [] for e in got)
    _assert_same_entries(got, expected)
    plain = client.responses.create(model=model_name, input=PROMPT, max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []  # not asked for


def test_streamed_logprobs_concatenate_to_the_whole(base_url: str, model_name: str):
    body = {
        "model": model_name,
        "input": PROMPT,
        "max_output_tokens": 8,
        "temperature": 0,
        "include": INCLUDE,
        "top_logprobs": TOP,
        "stream": True,
    }
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    assert reply.status == 200
    events = [json.loads(data) for _, data in parse_sse(reply.body)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    streamed = [entry for d in deltas for entry in d["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    part_done = next(e for e in events if e["type"] == "response.content_part.done")
    final = events[-1]["response"]
    whole = final["output"][0]["content"][0]["logprobs"]
    assert len(whole) == final["usage"]["output_tokens"] == 8
    assert streamed == done["logprobs"] == part_done["part"]["logprobs"] == whole
    assert "".join(d["delta"] for d in deltas) == done["text"]
    # the whole equals the non-streamed reply's
    body.pop("stream")
    plain = http("POST", f"{base_url}/v1/responses", json=body).json()
    _assert_same_entries(whole, plain["output"][0]["content"][0]["logprobs"])


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": [*INCLUDE, "file_search_call.results"]}, "include"),
        ({"include": ["no.such.value"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without the include
        ({"include": INCLUDE, "top_logprobs": 21}, "top_logprobs"),
        ({"include": INCLUDE, "top_logprobs": -1}, "top_logprobs"),
        (
            {
                "include": INCLUDE,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            },
            "include",
        ),
    ],
)
def test_bad_logprob_requests(base_url: str, extra: dict, param: str):
    reply = http("POST", f"{base_url}/v1/responses", json={"input": "x", **extra})
    assert_error(reply, 400, param=param)


REFUSED = [
    ("conversation", "conv_123"),
    ("conversation", {"id": "conv_123"}),
    ("prompt", {"id": "pmpt_123", "variables": {}}),
    ("reasoning", {"effort": "high"}),
    ("reasoning", {"summary": "auto"}),
    ("truncation", "auto"),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("context_management", [{"type": "compaction", "compact_threshold": 1000}]),
    ("text.verbosity", "low"),
    # any shape is refused as not served, not reported as mistyped
    ("prompt", "pmpt_123"),
    ("reasoning", "high"),
    ("truncation", 1),
    ("context_management", {}),
]


@pytest.mark.parametrize("field, value", REFUSED)
def test_documented_but_unimplemented_fields_are_refused(base_url: str, field: str, value):
    body: dict = {"input": "x", "max_output_tokens": 1}
    if field == "text.verbosity":
        body["text"] = {"verbosity": value}
    else:
        body[field] = value
    error = assert_error(http("POST", f"{base_url}/v1/responses", json=body), 400, param=field)
    assert "not supported" in error["message"] or "does not implement" in error["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True, "store": False}, "background"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # no stream
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"background": "yes"}, "background"),
    ],
)
def test_other_invalid_combinations(base_url: str, extra: dict, param: str):
    reply = http("POST", f"{base_url}/v1/responses", json={"input": "x", **extra})
    assert_error(reply, 400, param=param)


def test_defaults_and_hints_are_accepted(base_url: str, model_name: str):
    """The refused fields at their defaults, and the hints the reference lets a server ignore."""
    body = {
        "model": model_name,
        "input": "Say hi.",
        "max_output_tokens": 2,
        "temperature": 0,
        "conversation": None,
        "prompt": None,
        "reasoning": {"effort": None},
        "truncation": "disabled",
        "moderation": None,
        "context_management": [],
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "include": [],
        "top_logprobs": 0,
        "max_tool_calls": 4,
        "user": "u-1",
        "safety_identifier": "hash-of-user",
        "prompt_cache_key": "k-1",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "service_tier": "auto",
        "stream": True,
        "stream_options": {"include_obfuscation": True},
        "a_field_no_reference_lists": 1,  # unknown names are ignored, as OpenAI does
    }
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    assert reply.status == 200, reply.body
    final = json.loads(parse_sse(reply.body)[-1][1])["response"]
    assert final["status"] in ("completed", "incomplete")
    assert final["max_tool_calls"] == 4
    assert final["safety_identifier"] == "hash-of-user"
    assert final["prompt_cache_key"] == "k-1"
    assert final["truncation"] == "disabled"
    assert final["background"] is False
    assert final["output"][0]["content"][0]["logprobs"] == []
