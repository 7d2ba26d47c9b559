"""Tools built from nested pydantic models, as agent frameworks send them (``$defs``/``$ref``,
optional and enum fields, a list of objects), on the default model under ``auto``, ``required``
and a named choice, streamed and not, on chat completions and on Responses; and the openai SDK,
the Agents SDK and LangChain driving them. Every call's arguments validate against the tool's
own schema, streamed argument deltas join to the final arguments byte for byte, and the
conversation sent back with the tool's result is accepted."""

from __future__ import annotations

import asyncio
import json
from enum import Enum

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import http, parse_sse
from tests.server.responses.test_response_tools import agents_model, streamed_arguments


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Location(BaseModel):
    city: str = Field(max_length=12)
    country: str | None = Field(default=None, max_length=12)


class Options(BaseModel):
    unit: Unit = Unit.celsius
    days: int = Field(default=1, ge=1, le=7)


class Forecast(BaseModel):
    """A weather forecast request."""

    locations: list[Location] = Field(min_length=1, max_length=2)
    options: Options | None = None


SCHEMA = Forecast.model_json_schema()
NO_PARAMS = {"type": "object", "properties": {}}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "forecast", "description": "Weather forecast", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {"name": "ping", "description": "Ping", "parameters": NO_PARAMS},
    },
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
SCHEMAS = {"forecast": SCHEMA, "ping": NO_PARAMS}
ASK = "What will the weather be in Berlin and Rome?"
CHOICES = ["auto", "required", "named"]


def test_the_schema_is_nested():
    assert "$defs" in SCHEMA and '"$ref"' in json.dumps(SCHEMA)


def check_arguments(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def chat_choice(choice: str) -> object:
    return {"type": "function", "function": {"name": "forecast"}} if choice == "named" else choice


def chat_body(choice: str, **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": ASK}],
        "tools": CHAT_TOOLS,
        "tool_choice": chat_choice(choice),
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
        **kw,
    }


def chat_streamed(client: openai.OpenAI, body: dict) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
            call["args"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, list(calls.values()), finish


@pytest.mark.parametrize("choice", CHOICES)
def test_chat_calls_hold_the_nested_schema(client: openai.OpenAI, model_name: str, choice: str):
    body = chat_body(choice, model=model_name)
    whole = client.chat.completions.create(**body).choices[0]
    calls = whole.message.tool_calls or []
    if choice != "auto":
        assert calls, whole.message.content
    for call in calls:
        check_arguments(call.function.name, call.function.arguments)
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    content, streamed, finish = chat_streamed(client, body)
    assert (content, finish) == (whole.message.content or "", whole.finish_reason)
    assert [(c["name"], c["args"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    if not calls:
        return
    history = [
        *body["messages"],
        whole.message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "12 C"} for c in calls),
    ]
    answer = client.chat.completions.create(
        **{**body, "messages": history, "tool_choice": "none", "max_tokens": 10}
    )
    assert answer.choices[0].message.content


def responses_body(choice: str, **kw) -> dict:
    named = {"type": "function", "name": "forecast"}
    return {
        "input": ASK,
        "tools": RESPONSES_TOOLS,
        "tool_choice": named if choice == "named" else choice,
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
        "temperature": 0,
        **kw,
    }


@pytest.mark.parametrize("choice", CHOICES)
def test_responses_calls_hold_the_nested_schema(
    client: openai.OpenAI, base_url: str, model_name: str, choice: str
):
    body = responses_body(choice, model=model_name)
    whole = client.responses.create(**body)
    calls = [o for o in whole.output if o.type == "function_call"]
    if choice != "auto":
        assert calls, whole.output_text
    for call in calls:
        check_arguments(call.name, call.arguments)
    reply = http("POST", f"{base_url}/v1/responses", json={**body, "stream": True})
    events = [(e, json.loads(d)) for e, d in parse_sse(reply.body)]
    final = events[-1][1]["response"]
    streamed = [o for o in final["output"] if o["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls]
    for call in streamed:
        assert streamed_arguments(events, call["id"]) == (call["arguments"],) * 2
    if not calls:
        return
    results = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "12 C"} for c in calls
    ]
    answer = client.responses.create(
        **{**body, "input": results, "previous_response_id": whole.id, "tool_choice": "none"},
    )
    assert answer.status in ("completed", "incomplete") and answer.output_text


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_agents_sdk_with_a_nested_pydantic_tool(
    base_url: str, model_name: str, api: str, choice: str
):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    received: list[Forecast] = []

    @agents.function_tool
    def forecast(request: Forecast) -> str:
        """The weather forecast for some places."""
        received.append(request)
        return "12 C everywhere"

    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the forecast tool.",
        model=agents_model(base_url, model_name, api),
        tools=[forecast],
        model_settings=agents.ModelSettings(
            tool_choice=choice, max_tokens=80, temperature=0, parallel_tool_calls=False
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    assert "$defs" in json.dumps(forecast.params_json_schema)
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=2))
    if choice == "required":
        assert received and all(isinstance(r, Forecast) for r in received)
        assert result.final_output == "12 C everywhere"
    else:  # the model may answer in text instead; a call it makes is still whole
        assert all(isinstance(r, Forecast) for r in received)


def test_langchain_binds_a_nested_pydantic_tool(base_url: str, model_name: str):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        model=model_name,
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )
    for choice in ("Forecast", "any"):
        bound = llm.bind_tools([Forecast], tool_choice=choice, parallel_tool_calls=False)
        message = bound.invoke(ASK)
        assert message.tool_calls and message.tool_calls[0]["name"] == "Forecast"
        Forecast.model_validate(message.tool_calls[0]["args"])
        chunks = list(bound.stream(ASK))
        joined = chunks[0]
        for chunk in chunks[1:]:
            joined += chunk
        assert [c["args"] for c in joined.tool_calls] == [c["args"] for c in message.tool_calls]
