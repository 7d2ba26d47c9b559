"""Function tools in the Responses API on the default model: function_call output items,
function_call_output input items with previous_response_id, the streamed argument events, and
the OpenAI Agents SDK running a function-tool agent to completion with both its
chat-completions model and its responses model (tracing off; nothing leaves 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.server.conftest import assert_error, http, parse_sse
from tests.server.tools.test_tools import WEATHER_PARAMS

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": WEATHER_PARAMS,
}
NAMED = {"type": "function", "name": "get_weather"}


def create(client: openai.OpenAI, model: str, **kw):
    kw = {"input": "Weather in Paris?", "tools": [TOOL], "max_output_tokens": 60, **kw}
    return client.responses.create(model=model, temperature=0, **kw)


def test_function_call_item_then_output_with_previous_response_id(
    client: openai.OpenAI, model_name: str
):
    first = create(client, model_name, tool_choice=NAMED)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    answer = create(
        client, model_name, input=[result], previous_response_id=first.id, tool_choice="none"
    )
    assert answer.output[0].type == "message" and answer.output_text


def test_replayed_function_call_items(client: openai.OpenAI, model_name: str):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    reply = create(client, model_name, input=items, tool_choice="none", max_output_tokens=20)
    assert reply.output_text


def test_streamed_events_agree_with_the_whole(base_url: str, client, model_name: str):
    whole = create(client, model_name, tool_choice="required")
    body = {
        "input": "Weather in Paris?",
        "tools": [TOOL],
        "tool_choice": "required",
        "max_output_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    events = [(e, json.loads(d)) for e, d in parse_sse(reply.body)]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [e for e, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    final = events[-1][1]["response"]
    calls = [o for o in final["output"] if o["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (o.name, o.arguments) for o in whole.output if o.type == "function_call"
    ]
    for call in calls:
        assert streamed_arguments(events, call["id"]) == (call["arguments"],) * 2


def streamed_arguments(events: list[tuple[str, dict]], item_id: str) -> tuple[str, str]:
    """A streamed function_call item's argument deltas joined, and its done event's arguments."""
    deltas = "".join(
        d["delta"]
        for e, d in events
        if e == "response.function_call_arguments.delta" and d["item_id"] == item_id
    )
    [done] = [
        d["arguments"]
        for e, d in events
        if e == "response.function_call_arguments.done" and d["item_id"] == item_id
    ]
    return deltas, done


def test_unknown_call_id_is_a_400(base_url: str):
    body = {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    assert_error(reply, 400, param="input[0].call_id")


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_runs_a_function_tool_agent(base_url: str, model_name: str, api: str):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer weather questions with the tool.",
        model=agents_model(base_url, model_name, api),
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=60, temperature=0, parallel_tool_calls=False
        ),
        tool_use_behavior=stop_on_second_call,
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    # two model turns: the second saw the first call and its output (function_call_output)
    assert len(calls) == 2
    assert result.final_output == f"18 C and sunny in {calls[1]}"


def agents_model(base_url: str, model_name: str, api: str):
    """The Agents SDK's chat-completions or responses model, on this server."""
    import agents

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    if api == "chat_completions":
        return agents.OpenAIChatCompletionsModel(model=model_name, openai_client=client)
    return agents.OpenAIResponsesModel(model=model_name, openai_client=client)


def stop_on_second_call(context, results):
    """The 135M model calls its tool again rather than answer; stop after its second call, so
    the run still takes a second model turn over the first call's output."""
    from agents import ToolsToFinalOutputResult

    done = context.usage.requests >= 2
    return ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output)
