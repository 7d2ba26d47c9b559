"""Tool calls streamed as OpenAI streams them, on the tiny random-weight model with the default
model's tokenizer (``random_client``), where only the grammar of a forced choice shapes
the reply: a note of four strings of up to 20 characters, a call some 40 tokens long.

* Argument fragments go out as they are generated, several for one call, and join into exactly
  the non-streamed reply's arguments: through the openai SDK's chat stream helper, the Agents
  SDK (its chat-completions model and its responses model) and a raw Responses stream.
* A forced call (``required``, a named function) that ``max_tokens`` cuts off is no call:
  ``finish_reason: "length"``, ``tool_calls: []`` and ``content: ""`` on chat; status
  ``incomplete`` and an empty output on Responses; streamed, no content at all and, if the call
  had opened, its fragments a prefix of the arguments the uncut reply gets.
* Under ``auto`` (``--tool-call-parser hermes``, a regex shaping the reply like a Qwen
  model's) a cut-off call is text in the whole reply and an unfinished call in the stream.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import http, parse_sse, wait_idle
from tests.server.responses.test_response_tools import agents_model, streamed_arguments
from tests.server.tools.test_tool_arguments import is_json

FIELDS = ("path", "title", "body", "tags")
NOTE = {
    "type": "object",
    "properties": {name: {"type": "string", "maxLength": 20} for name in FIELDS},
    "required": list(FIELDS),
    "additionalProperties": False,
}
WRITE = {
    "type": "function",
    "function": {"name": "write_note", "description": "Write a note", "parameters": NOTE},
}
ASK = "Write a note about Paris."
CHOICES = ("required", "named")
UNCUT = 120  # max_tokens that leaves the call whole
MODEL = "random-llama"


@pytest.fixture(scope="module")
def url(random_client: openai.OpenAI) -> str:
    """The random model's server (without /v1)."""
    return str(random_client.base_url).rstrip("/").removesuffix("/v1")


@pytest.fixture(autouse=True)
def random_pool_clean(random_engine: AsyncEngine):
    yield
    wait_idle(random_engine)
    random_engine.check_integrity()
    assert random_engine.snapshot().kv_blocks_used == 0


def chat_body(choice: str, max_tokens: int, **kw) -> dict:
    """A chat request for one ``write_note`` call (``required`` without parallel calls, so
    the grammar ends the list after it)."""
    named = {"type": "function", "function": {"name": "write_note"}}
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=[WRITE],
        tool_choice="required" if choice == "required" else named,
        parallel_tool_calls=False,
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )


def responses_body(choice: str, max_tokens: int, **kw) -> dict:
    tool_choice = "required" if choice == "required" else {"type": "function", "name": "write_note"}
    tool = {"type": "function", **WRITE["function"]}
    return {
        "model": MODEL,
        "input": ASK,
        "tools": [tool],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


def stream_chat(client: openai.OpenAI, body: dict) -> tuple[str, list[dict], str | None]:
    """A chat stream's content, calls (name, joined arguments, fragment count) and finish."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name
                assert d.function.arguments == ""
                calls[d.index] = {"name": d.function.name, "arguments": "", "fragments": 0}
                continue
            assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments
            calls[d.index]["fragments"] += 1
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def post_responses(base_url: str, body: dict) -> dict | list[tuple[str, dict]]:
    """The Response object, or a stream's (event, data) pairs."""
    reply = http("POST", f"{base_url}/v1/responses", json=body)
    assert reply.status == 200, reply.body
    if body.get("stream"):
        return [(event, json.loads(data)) for event, data in parse_sse(reply.body)]
    return reply.json()


@pytest.fixture(scope="module")
def uncut(random_client: openai.OpenAI, url: str) -> dict[tuple[str, str], str]:
    """The call's whole arguments, by (API, choice), when max_tokens does not cut it."""
    out = {}
    for choice in CHOICES:
        reply = random_client.chat.completions.create(**chat_body(choice, UNCUT)).choices[0]
        assert reply.finish_reason == "tool_calls"
        out["chat", choice] = reply.message.tool_calls[0].function.arguments
        response = post_responses(url, responses_body(choice, UNCUT))
        assert response["status"] == "completed"
        out["responses", choice] = response["output"][0]["arguments"]
    return out


def test_chat_stream_helper_joins_fragments_into_the_arguments(random_client: openai.OpenAI):
    """The openai SDK's stream helper (which reads every running join as partial JSON) sees
    many fragments, each running join a prefix of the non-streamed reply's arguments."""
    strict = {"type": "function", "function": {**WRITE["function"], "strict": True}}
    body = chat_body("named", UNCUT) | {"tools": [strict]}
    whole = random_client.chat.completions.create(**body).choices[0]
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), NOTE)
    fragments = []
    with random_client.chat.completions.stream(**body) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
                assert call.function.arguments.startswith(event.arguments)
        final = stream.get_final_completion().choices[0]
    assert len(fragments) > 10
    assert "".join(fragments) == final.message.tool_calls[0].function.arguments
    assert final.message.tool_calls[0].function.arguments == call.function.arguments
    assert final.finish_reason == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_streams_argument_fragments(url: str, api: str):
    """A streamed Agents SDK run: its ``response.function_call_arguments.delta`` events (made
    from chat deltas by its chat-completions model, passed through by its responses model)
    are many and join into the arguments the tool is called with."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    async def write_note(context, arguments: str) -> str:
        called.append(arguments)
        return "saved"

    tool = agents.FunctionTool(
        name="write_note",
        description="Write a note",
        params_json_schema=NOTE,
        on_invoke_tool=write_note,
        strict_json_schema=False,
    )
    agent = agents.Agent(
        name="notes",
        instructions="Write notes with the tool.",
        model=agents_model(url, MODEL, api),
        tools=[tool],
        model_settings=agents.ModelSettings(
            tool_choice="write_note", max_tokens=UNCUT, temperature=0, parallel_tool_calls=False
        ),
        tool_use_behavior="stop_on_first_tool",
    )

    async def run() -> list[str]:
        result = agents.Runner.run_streamed(agent, ASK, max_turns=2)
        deltas = []
        async for event in result.stream_events():
            data = getattr(event, "data", None)
            if getattr(data, "type", None) == "response.function_call_arguments.delta":
                deltas.append(data.delta)
        assert result.final_output == "saved"
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas) > 10
    [arguments] = called
    assert "".join(deltas) == arguments
    jsonschema.validate(json.loads(arguments), NOTE)


def test_responses_stream_sends_argument_fragments(url: str, uncut):
    events = post_responses(url, responses_body("named", UNCUT, stream=True))
    final = events[-1][1]["response"]
    [call] = final["output"]
    assert call["arguments"] == uncut["responses", "named"]
    assert len([e for e, _ in events if e == "response.function_call_arguments.delta"]) > 10
    assert streamed_arguments(events, call["id"]) == (call["arguments"],) * 2
    kinds = [e for e, _ in events]
    added = kinds.index("response.output_item.added")
    assert kinds[added + 1] == "response.function_call_arguments.delta"  # no wait for the end


@pytest.mark.parametrize("max_tokens", [1, 5, 20])
@pytest.mark.parametrize("choice", CHOICES)
def test_a_forced_call_cut_off_by_max_tokens_on_chat(
    random_client: openai.OpenAI, uncut, choice: str, max_tokens: int
):
    body = chat_body(choice, max_tokens)
    reply = random_client.chat.completions.create(**body).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.tool_calls == [] and reply.message.content == ""
    content, calls, finish = stream_chat(random_client, body)
    assert (content, finish) == ("", "length")
    assert len(calls) <= 1
    if choice == "named" and max_tokens >= 5:  # the reply is the arguments: open from the start
        assert calls
    for call in calls:  # opened before the cut: unfinished, a prefix of the uncut arguments
        assert call["name"] == "write_note" and not is_json(call["arguments"])
        assert uncut["chat", choice].startswith(call["arguments"])


@pytest.mark.parametrize("max_tokens", [1, 5, 20])
@pytest.mark.parametrize("choice", CHOICES)
def test_a_forced_call_cut_off_by_max_tokens_on_responses(
    url: str, uncut, choice: str, max_tokens: int
):
    response = post_responses(url, responses_body(choice, max_tokens))
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"] == []
    events = post_responses(url, responses_body(choice, max_tokens, stream=True))
    kinds = [e for e, _ in events]
    assert kinds[-1] == "response.incomplete" and events[-1][1]["response"]["output"] == []
    assert "response.output_text.delta" not in kinds
    assert "response.function_call_arguments.done" not in kinds
    items = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert [item["status"] for item in items] == ["incomplete"] * len(items)
    assert len(items) <= 1
    if choice == "named" and max_tokens >= 5:
        assert items
    for item in items:  # opened before the cut: its deltas, a prefix of the uncut arguments
        deltas = "".join(
            d["delta"] for e, d in events if e == "response.function_call_arguments.delta"
        )
        assert item["arguments"] == deltas and not is_json(deltas)
        assert uncut["responses", choice].startswith(deltas)


HERMES_NOTE = (
    r'Sure\. <tool_call>\{"name": "write_note", "arguments": '
    r'\{"text": "[a-z]{1,8}( [a-z]{1,8}){9}"\}\}</tool_call>'
)


def test_an_auto_call_cut_off_is_text_whole_and_unfinished_streamed(
    random_engine: AsyncEngine, server_thread
):
    """Under ``auto`` the call opens in the stream once its name is whole and its arguments
    have opened; cut off two tokens later, the whole reply has its text as content and no
    call, the stream the unfinished call and no text."""
    from paged_serve.server.app import create_app

    hermes = server_thread.serve(lambda: create_app(random_engine, tool_call_parser="hermes"))
    client = openai.OpenAI(base_url=f"{hermes}/v1", api_key="unused", max_retries=0, timeout=60)
    regex = {"structured_outputs": {"regex": HERMES_NOTE}}
    body = chat_body("named", UNCUT, extra_body=regex) | {"tool_choice": "auto"}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    [call] = whole.message.tool_calls
    opened_at = None  # how many tokens the stream had when the call opened
    counted = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for chunk in client.chat.completions.create(
        stream=True, **(body | {"extra_body": regex | counted})
    ):
        if chunk.choices and chunk.choices[0].delta.tool_calls and opened_at is None:
            opened_at = chunk.usage.completion_tokens
    assert opened_at is not None
    cut_body = body | {"max_tokens": opened_at + 2}
    cut = client.chat.completions.create(**cut_body).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith('Sure.\n<tool_call>{"name": "write_note"')
    content, calls, finish = stream_chat(client, cut_body)
    assert (content, finish) == ("Sure.", "length")
    [unfinished] = calls
    assert unfinished["name"] == "write_note" and unfinished["fragments"] >= 1
    assert call.function.arguments.startswith(unfinished["arguments"])
    assert not is_json(unfinished["arguments"])
    content, calls, finish = stream_chat(client, body)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]
