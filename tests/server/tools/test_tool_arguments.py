"""Tool-call ``arguments`` are the JSON text of a whole object on every path, or there is no
call: a list of calls cut off by ``max_tokens``, a tool without parameters, a call cut off in
its arguments, chat and Responses, streamed and whole (a stream's call cut off while its
fragments went out stays unfinished there, after the whole ones). Then a property test over
generated tool schemas and ``max_tokens`` on a tiny random-weight model with the default
model's tokenizer, where nothing but the grammar keeps the output valid; the block pool is
intact after each."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import http, parse_sse, wait_idle
from tests.server.responses.test_response_tools import streamed_arguments

PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "Weather in Berlin? Also ping."}]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def check_unfinished(whole: list, streamed: list[tuple[str, str]], finish: str) -> None:
    """The stream's calls are the whole reply's, then at most the one ``max_tokens`` cut off
    after it opened, whose arguments are not JSON yet."""
    whole = [(c.function.name, c.function.arguments) for c in whole]
    assert streamed[: len(whole)] == whole
    unfinished = streamed[len(whole) :]
    assert len(unfinished) <= (finish == "length")
    assert not any(is_json(arguments) for _, arguments in unfinished)


def streamed_chat(client: openai.OpenAI, **body) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name, args = calls.get(d.index, (d.function.name, ""))
            calls[d.index] = (name, args + (d.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return content, list(calls.values()), finish


@pytest.mark.parametrize("tools", [[PING], [WEATHER, PING]])
def test_a_list_of_calls_holds_only_whole_calls(
    client: openai.OpenAI, model_name: str, tools: list
):
    """With the parameterless tool alone the small model repeats its call until max_tokens;
    each whole call has JSON arguments (a parameterless tool's are ``{}``), the cut-off one
    stays text."""
    body = dict(model=model_name, messages=ASK, tools=tools, tool_choice="required")
    body |= dict(max_tokens=40, temperature=0)
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.finish_reason == ("length" if tools == [PING] else "tool_calls")
    calls = reply.message.tool_calls
    assert calls
    for call in calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "ping":
            assert arguments == {}
        else:
            jsonschema.validate(arguments, CITY)
    assert reply.message.content is None  # a forced reply has no text, even when cut off
    content, streamed, finish = streamed_chat(client, **body)
    assert (content, finish) == ("", reply.finish_reason)
    check_unfinished(calls, streamed, finish)


def test_a_forced_call_cut_off_in_its_arguments_is_no_call(client: openai.OpenAI, model_name: str):
    """An empty list and empty content (not null and the partial JSON): clients count
    ``tool_calls``. Streamed, the call opened and its fragments stay a prefix of the
    arguments the uncut reply gets."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(model=model_name, messages=ASK, tools=[WEATHER], tool_choice=named)
    reply = client.chat.completions.create(max_tokens=3, temperature=0, **body).choices[0]
    assert reply.finish_reason == "length" and reply.message.tool_calls == []
    assert reply.message.content == ""
    whole = client.chat.completions.create(max_tokens=40, temperature=0, **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    content, streamed, finish = streamed_chat(client, max_tokens=3, temperature=0, **body)
    assert (content, finish) == ("", "length")
    check_unfinished([], streamed, finish)
    for name, arguments in streamed:
        assert name == "get_weather"
        assert whole.message.tool_calls[0].function.arguments.startswith(arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_arguments_are_whole_json(base_url: str, model_name: str, choice, stream):
    tool = {"type": "function", **WEATHER["function"]}
    body = {"model": model_name, "input": "Weather in Berlin?", "tools": [tool]}
    body |= {"tool_choice": choice, "max_output_tokens": 60, "temperature": 0, "stream": stream}
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    assert reply.status == 200, reply.body
    events = [(e, json.loads(d)) for e, d in parse_sse(reply.body)] if stream else []
    response = events[-1][1]["response"] if stream else reply.json()
    calls = [o for o in response["output"] if o["type"] == "function_call"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), CITY)
        if stream:
            assert streamed_arguments(events, call["id"]) == (call["arguments"],) * 2


# ---------------------------------------------------------------- the property test
def leaf_schemas() -> st.SearchStrategy[dict]:
    short = st.text("abcxyz", min_size=1, max_size=3)
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.just({"type": "integer"}),
        st.just({"type": "boolean"}),
        st.builds(lambda xs: {"enum": sorted(set(xs))}, st.lists(short, min_size=1, max_size=3)),
        st.builds(lambda x: {"const": x}, short),
    )


def schemas() -> st.SearchStrategy[dict]:
    def grow(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return st.one_of(
            st.builds(lambda s: {"type": "array", "items": s, "maxItems": 2}, children),
            st.builds(lambda s: {"anyOf": [s, {"type": "null"}]}, children),
            objects(children),
        )

    return st.recursive(leaf_schemas(), grow, max_leaves=5)


def objects(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    names = st.lists(st.sampled_from("abcde"), min_size=0, max_size=3, unique=True)

    def shaped(keys: list[str]) -> st.SearchStrategy[dict]:
        properties = st.fixed_dictionaries({k: values for k in keys})
        required = st.lists(st.sampled_from(keys), unique=True) if keys else st.just([])
        return st.builds(
            lambda p, r: {
                "type": "object",
                "properties": p,
                "required": [k for k in keys if k in r],
                "additionalProperties": False,
            },
            properties,
            required,
        )

    return names.flatmap(shaped)


def with_defs(schema: dict, shared: dict | None) -> dict:
    """``schema`` as a tool's parameters, with ``shared`` moved into ``$defs`` and referenced
    from a property (the shape pydantic gives nested models)."""
    root = (
        schema
        if schema.get("type") == "object"
        else {
            "type": "object",
            "properties": {"v": schema},
            "required": ["v"],
            "additionalProperties": False,
        }
    )
    if shared is None:
        return root
    return {
        **root,
        "$defs": {"Shared": shared},
        "properties": {**root["properties"], "s": {"$ref": "#/$defs/Shared"}},
    }


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    schema=schemas(),
    shared=st.none() | schemas(),
    max_tokens=st.integers(1, 64),
    choice=st.sampled_from(["named", "required", "auto"]),
    seed=st.integers(0, 2**16),
)
def test_arguments_are_never_invalid_json(
    random_client: openai.OpenAI,
    random_engine: AsyncEngine,
    schema,
    shared,
    max_tokens,
    choice,
    seed,
):
    parameters = with_defs(schema, shared)
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}, PING]
    tool_choice = {"type": "function", "function": {"name": "f"}} if choice == "named" else choice
    body = dict(model="random-llama", messages=ASK, tools=tools, tool_choice=tool_choice)
    body |= dict(max_tokens=max_tokens, temperature=1.0, seed=seed)
    reply = random_client.chat.completions.create(**body).choices[0]
    calls = reply.message.tool_calls or []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, parameters if call.function.name == "f" else {})
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert (reply.finish_reason == "tool_calls") == (
        bool(calls) and reply.finish_reason != "length"
    )
    content, streamed, finish = streamed_chat(random_client, **body)
    assert finish == reply.finish_reason
    check_unfinished(calls, streamed, finish)
    # a call cut off after it opened is not sent again as content (the whole reply's, under auto)
    cut_off = len(streamed) > len(calls)
    assert content == ("" if cut_off else reply.message.content or "")
    if choice != "auto":
        assert reply.message.content in (None, "") and reply.message.tool_calls is not None
    wait_idle(random_engine)
    random_engine.check_integrity()
    assert random_engine.snapshot().kv_blocks_used == 0
