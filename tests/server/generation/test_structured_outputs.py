"""Structured outputs through the server, with the clients apps use: the openai SDK's
``parse``, LangChain's ``with_structured_output`` (json_schema and json_mode), instructor's
JSON mode, and raw ``response_format`` / ``structured_outputs`` / ``guided_*`` / Responses
``text.format`` bodies. Every reply must satisfy its constraint; bad constraints are 400s
naming the field. The ``pool_clean`` fixture checks the block pool after each test."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import assert_error, http, parse_sse

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


class Capital(BaseModel):
    country: str = Field(max_length=24)
    capital: str = Field(max_length=24)


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


def chat(client: openai.OpenAI, model: str, **kw):
    kw = {"messages": QUESTION, "max_tokens": 80, "temperature": 0, **kw}
    return client.chat.completions.create(model=model, **kw)


def json_schema_format(schema: dict, name: str = "city") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI, model_name: str):
    completion = client.chat.completions.parse(
        model=model_name, messages=QUESTION, response_format=Capital, max_tokens=80, temperature=0
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert completion.choices[0].finish_reason == "stop"


def test_chat_json_schema_stream_and_whole_agree(client: openai.OpenAI, model_name: str):
    fmt = json_schema_format(CITY_SCHEMA)
    whole = chat(client, model_name, response_format=fmt).choices[0].message.content
    jsonschema.validate(json.loads(whole), CITY_SCHEMA)
    chunks = chat(client, model_name, response_format=fmt, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole


def test_json_object_and_seeded_samples(client: openai.OpenAI, model_name: str):
    replies = chat(
        client,
        model_name,
        response_format={"type": "json_object"},
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=60,
    )
    for choice in replies.choices:
        if choice.finish_reason == "stop":  # a sampled object may still run to max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in replies.choices)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}}, r"Paris|Lyon|Nice"),
        ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]?'}}, r"x=[0-9][0-9]?"),
        ({"guided_regex": r"(yes|no)!"}, r"(yes|no)!"),
        ({"guided_choice": ["alpha", "beta"]}, r"alpha|beta"),
    ],
)
def test_completions_regex_choice_and_grammar_hold_exactly(
    client: openai.OpenAI, model_name: str, extra: dict, check: str
):
    reply = client.completions.create(
        model=model_name, prompt="The answer:", max_tokens=12, temperature=0.8, seed=3,
        extra_body=extra,
    )  # fmt: skip
    assert re.fullmatch(check, reply.choices[0].text), reply.choices[0].text


def test_completions_json_schema_and_guided_json(client: openai.OpenAI, model_name: str):
    forms = ({"response_format": json_schema_format(CITY_SCHEMA)}, {"guided_json": CITY_SCHEMA})
    for extra in forms:
        reply = client.completions.create(
            model=model_name, prompt="A city as JSON:", max_tokens=80, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        jsonschema.validate(json.loads(reply.choices[0].text), CITY_SCHEMA)


def test_responses_text_format(client: openai.OpenAI, model_name: str):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
              "required": ["colour"]}  # fmt: skip
    fmt = {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}
    response = client.responses.create(
        model=model_name, input="Name a colour.", text={"format": fmt}, max_output_tokens=30
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "colour"
    plain = client.responses.create(model=model_name, input="Hi", max_output_tokens=2)
    assert plain.text.format.type == "text"


def test_langchain_with_structured_output(base_url: str, model_name: str):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", model=model_name, temperature=0,
        max_tokens=80, max_retries=0,
    )  # fmt: skip
    by_schema = llm.with_structured_output(Capital)  # LangChain's default: json_schema
    assert isinstance(by_schema.invoke("What is the capital of France?"), Capital)
    by_json_mode = llm.with_structured_output(Capital, method="json_mode")
    result = by_json_mode.invoke(
        "Reply in JSON with keys country and capital: what is the capital of France?"
    )
    assert isinstance(result, Capital)


@pytest.mark.parametrize("mode", ["JSON", "JSON_SCHEMA"])
def test_instructor_json_modes(base_url: str, model_name: str, mode: str):
    """JSON mode sends ``json_object`` (any object) with the schema in a system message, so the
    keys are the model's business: the 135M default model copies the schema back for a bare
    question, and finds the keys for an extraction prompt (greedy, so this is deterministic).
    JSON_SCHEMA mode sends the schema as the constraint itself, whose properties the grammar
    writes in the order the model class declares them."""
    import instructor

    raw = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    patched = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    result = patched.chat.completions.create(
        model=model_name,
        response_model=Capital,
        messages=[
            {
                "role": "user",
                "content": "France's capital is Paris. Extract the country and its capital.",
            }
        ],  # fmt: skip
        max_tokens=80,
        temperature=0,
        max_retries=0,
    )
    if mode == "JSON":
        assert (result.country, result.capital) == ("France", "Paris")
    else:  # country first, as Capital declares it; the 135M model then shouts the country
        assert result.country.lower() == "france" and "Paris" in result.capital


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        ("chat/completions", {"response_format": json_schema_format({"type": "objec"})},
         "response_format", "invalid"),
        ("chat/completions",
         {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
         "response_format", "unsupported JSON schema keyword 'uniqueItems'"),
        ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format",
         "needs json_schema"),
        ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format",
         "unsupported response_format type"),
        ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs", "invalid"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs", "exactly one"),
        ("completions", {"structured_outputs": {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}},
         "structured_outputs", "admits no output"),
        ("completions", {"guided_choice": []}, "guided_choice", "choice needs 1 to"),
        ("completions", {"guided_json": {"type": "objec"}, "guided_regex": "a"}, "guided_regex",
         "at most one"),
        ("completions", {"response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "both constrain"),
        ("responses", {"text": {"format": {"type": "json_schema"}}}, "text.format",
         "needs its schema"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(
    base_url: str, engine: AsyncEngine, path: str, body: dict, param: str, message: str
):
    base = {"chat/completions": {"messages": QUESTION}, "completions": {"prompt": "x"},
            "responses": {"input": "x"}}[path]  # fmt: skip
    reply = http("POST", f"{base_url}/v1/{path}", json={**base, **body, "max_tokens": 4})
    error = assert_error(reply, 400, param=param)
    assert message in error["message"]
    # The server goes on serving.
    ok = http("POST", f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status == 200


def test_a_deeply_nested_schema_is_bounded(base_url: str, engine: AsyncEngine):
    schema: dict = {"type": "integer"}
    for _ in range(80):
        schema = {"type": "array", "items": schema}
    reply = http(
        "POST",
        f"{base_url}/v1/chat/completions",
        json={"messages": QUESTION, "response_format": json_schema_format(schema)},
    )
    assert "nests deeper" in assert_error(reply, 400, param="response_format")["message"]


def test_constrained_stream_frames_are_well_formed(base_url: str, engine: AsyncEngine):
    reply = http(
        "POST",
        f"{base_url}/v1/chat/completions",
        json={"messages": QUESTION, "stream": True, "max_tokens": 80, "temperature": 0,
              "response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert reply.status == 200
    frames = [data for _, data in parse_sse(reply.body)]
    assert frames[-1] == "[DONE]"
    text = "".join(
        c["delta"].get("content") or "" for f in frames[:-1] for c in json.loads(f)["choices"]
    )
    assert isinstance(json.loads(text), dict)
