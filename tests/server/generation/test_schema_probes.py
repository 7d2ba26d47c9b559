"""Issue 31, item 3, through the server: the review's probes at temperature 1, n=8. Schemas the
grammar cannot hold are 400s naming the field, the keyword and its path; the others hold in
every sample (checked with ``jsonschema``). ``pool_clean`` checks that no KV block leaks."""

from __future__ import annotations

import ipaddress
import json

import jsonschema
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import assert_error, http

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def body(schema: dict) -> dict:
    return {
        "messages": MESSAGES,
        "max_tokens": 60,
        "temperature": 1,
        "n": 8,
        "seed": 31,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "required": ["name", "age"]},
        {"minLength": 12},
        {"type": "string", "maxLength": 3},
        {"type": "string", "format": "ipv4"},
    ],
    ids=["required-without-properties", "untyped-minLength", "maxLength", "ipv4"],
)
def test_an_accepted_probe_holds_in_every_sample(base_url: str, engine: AsyncEngine, schema: dict):
    reply = http("POST", f"{base_url}/v1/chat/completions", json=body(schema))
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    assert len(choices) == 8
    for choice in choices:
        if choice["finish_reason"] != "stop":  # cut by max_tokens: nothing to validate
            continue
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        if schema.get("format") == "ipv4":
            ipaddress.IPv4Address(value)
    assert any(c["finish_reason"] == "stop" for c in choices)


@pytest.mark.parametrize(
    "schema, message",
    [
        (
            {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
            "unsupported JSON schema keyword 'maxLength' at schema:",
        ),
        (
            {
                "type": "object",
                "properties": {"code": {"type": "string", "pattern": "[A-Z]+", "minLength": 12}},
            },
            "unsupported JSON schema keyword 'minLength' at schema.properties.code:",
        ),
        (
            {"type": "object", "properties": {"host": {"type": "string", "format": "uri"}}},
            "unsupported JSON schema keyword 'format' at schema.properties.host:",
        ),
    ],
    ids=["pattern-maxLength", "pattern-minLength", "format-uri"],
)
def test_a_probe_the_grammar_cannot_hold_is_a_400_naming_it(
    base_url: str, engine: AsyncEngine, schema: dict, message: str
):
    reply = http("POST", f"{base_url}/v1/chat/completions", json=body(schema))
    error = assert_error(reply, 400, param="response_format")
    assert message in error["message"]
