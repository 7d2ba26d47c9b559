"""Chat tools end to end on the default model (SmolLM2, whose template has no tools, so the
generic format applies): named and required tool_choice always give schema-valid arguments,
streamed and whole replies agree, a full tool loop with the openai SDK, LangChain's
``bind_tools``, instructor's TOOLS mode, and 400s naming the field for bad input."""

from __future__ import annotations

import json

import instructor
import jsonschema
import openai
import pytest
from langchain_core.tools import tool as lc_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import assert_error, http

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone",
            "parameters": TIME_PARAMS,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client: openai.OpenAI, model: str, **kw):
    kw = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **kw}
    return client.chat.completions.create(model=model, **kw)


def streamed(client: openai.OpenAI, model: str, **kw) -> tuple[str, list[dict], str]:
    """The content, calls and finish reason a stream adds up to."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, model, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name  # id and name come first
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def check_calls(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_choice_gives_valid_arguments(client: openai.OpenAI, model_name: str, seed: int):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(client, model_name, tool_choice=choice, temperature=1.0, seed=seed).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert reply.message.content is None
    [call] = reply.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    check_calls([call])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_choice_gives_valid_calls(client: openai.OpenAI, model_name: str, parallel):
    reply = chat(
        client,
        model_name,
        tool_choice="required",
        parallel_tool_calls=parallel,
        seed=3,
        temperature=1.0,
    ).choices[0]
    assert reply.finish_reason == "tool_calls"
    calls = reply.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    check_calls(calls)


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_stream_and_whole_agree(client: openai.OpenAI, model_name: str, tool_choice):
    whole = chat(client, model_name, tool_choice=tool_choice).choices[0]
    content, calls, finish = streamed(client, model_name, tool_choice=tool_choice)
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]
    assert finish == whole.finish_reason


def test_none_choice_answers_in_text(client: openai.OpenAI, model_name: str):
    reply = chat(client, model_name, tool_choice="none", max_tokens=10).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    assert reply.finish_reason in ("stop", "length")


def test_full_tool_loop(client: openai.OpenAI, model_name: str):
    first = chat(client, model_name, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    [call] = message.tool_calls
    result = {"get_weather": "18 C and sunny", "get_time": "14:05"}[call.function.name]
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = chat(client, model_name, messages=history, tool_choice="none", max_tokens=30)
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None
    # under auto the conversation renders too, and the reply is a call or an answer
    again = chat(client, model_name, messages=history, parallel_tool_calls=False).choices[0]
    assert again.message.content or again.message.tool_calls
    if again.finish_reason == "tool_calls":
        check_calls(again.message.tool_calls)


def test_langchain_bind_tools(base_url: str, model_name: str):
    @lc_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        model=model_name,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?"
    )
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    # the small model keeps adding calls to a list until max_tokens: ask for one
    forced = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False)
    forced = forced.invoke("Weather in Rome?")
    assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"


class Weather(BaseModel):
    city: str = Field(max_length=20)
    temperature_c: int = Field(ge=-50, le=60)


def test_instructor_tools_mode(client: openai.OpenAI, model_name: str):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    weather = patched.chat.completions.create(
        model=model_name,
        messages=ASK,
        response_model=Weather,
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(weather, Weather)


def post(base_url: str, **body):
    body = {"messages": ASK, "max_tokens": 5, **body}
    return http("POST", f"{base_url}/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"not": {"type": "string"}}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
            "messages[1].tool_call_id",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{nope"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url: str, body: dict, param: str):
    assert_error(post(base_url, **body), 400, param=param)


HERMES_REPLY = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}</tool_call>'
)


def test_tool_call_parser_flag_on_real_token_boundaries(engine, server_thread, model_name):
    """--tool-call-parser hermes on SmolLM2 (whose template has no tools): a regex shapes the
    reply like a Qwen model's, so the parser meets the tokenizer's real token boundaries."""
    from paged_serve.server.app import create_app

    url = server_thread.serve(lambda: create_app(engine, tool_call_parser="hermes"))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    kw = {"extra_body": {"structured_outputs": {"regex": HERMES_REPLY}}, "max_tokens": 60}
    whole = chat(client, model_name, **kw).choices[0]
    assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    check_calls([call])
    chunks = list(chat(client, model_name, stream=True, **kw))
    assert all("<" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    content, calls, finish = streamed(client, model_name, **kw)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
