"""The one tool-list-to-grammar path (``paged_serve.server.tools.grammar``): a tool schema with
``$defs``, ``definitions`` and recursive references means the same under a named, ``required`` and
``auto`` choice (checked with xgrammar's own matcher against jsonschema's verdict on the same
text), and references the grammar could not follow are refused naming the keyword."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from paged_serve.server.tools.grammar import ToolGrammar, ToolSchemaError, checked_parameters

WEATHER = {
    "$defs": {
        "Unit": {"enum": ["celsius", "fahrenheit"]},
        "Options": {
            "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}, "days": {"type": "integer"}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "options": {"$ref": "#/$defs/Options"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["city", "options"],
    "additionalProperties": False,
}
TREE = {  # recursive through the root itself and through old-style definitions
    "definitions": {"Leaf": {"type": "object", "properties": {"v": {"const": 1}}}},
    "type": "object",
    "properties": {
        "leaf": {"$ref": "#/definitions/Leaf"},
        "kids": {"type": "array", "items": {"$ref": "#"}},
    },
    "required": ["kids"],
    "additionalProperties": False,
}
GOOD = {
    "get_weather": '{"city": "Rome", "options": {"unit": "celsius"}, "note": null}',
    "tree": '{"kids": [{"leaf": {"v": 1}, "kids": []}]}',
}
BAD = {
    "get_weather": '{"city": "Rome", "options": {"unit": "kelvin"}}',
    "tree": '{"kids": [{"leaf": {"v": 1}}]}',
}
SCHEMAS = {"get_weather": WEATHER, "tree": TREE}


def accepts(structured, text: str) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(structured.spec)
    return _is_grammar_accept_string(grammar, text)


@pytest.fixture(scope="module")
def grammar() -> ToolGrammar:
    return ToolGrammar({name: checked_parameters(s) for name, s in SCHEMAS.items()})


def test_jsonschema_agrees_with_the_fixtures():
    for name, schema in SCHEMAS.items():
        jsonschema.validate(json.loads(GOOD[name]), schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(BAD[name]), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_named_choice_resolves_references(grammar: ToolGrammar, name: str):
    assert accepts(grammar.named(name), GOOD[name])
    assert not accepts(grammar.named(name), BAD[name])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_required_and_auto_resolve_the_same_references(grammar: ToolGrammar, name: str):
    call = f'{{"name": "{name}", "arguments": {GOOD[name]}}}'
    bad = f'{{"name": "{name}", "arguments": {BAD[name]}}}'
    assert accepts(grammar.required(parallel=True), f"[{call}, {call}]")
    assert not accepts(grammar.required(parallel=True), f"[{bad}]")
    assert not accepts(grammar.required(parallel=False), f"[{call}, {call}]")
    assert accepts(grammar.envelope(parallel=True), f'{{"tool_calls": [{call}]}}')
    assert accepts(grammar.envelope(parallel=False), f'{{"tool_call": {call}}}')
    assert not accepts(grammar.envelope(parallel=False), f'{{"tool_call": {bad}}}')
    assert accepts(grammar.envelope(parallel=True), '{"response": "hi"}')


def test_a_call_names_only_its_own_tool(grammar: ToolGrammar):
    swapped = f'[{{"name": "tree", "arguments": {GOOD["get_weather"]}}}]'
    assert not accepts(grammar.required(parallel=True), swapped)


def test_the_callers_schema_is_not_modified():
    before = json.dumps(WEATHER, sort_keys=True)
    ToolGrammar({"w": checked_parameters(WEATHER)}).required(parallel=True)
    assert json.dumps(WEATHER, sort_keys=True) == before


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "other.json"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "points at nothing"),
        ({"type": "object", "properties": {"a": {"$ref": "#Name"}}}, "'#Name'"),
        (
            {"type": "object", "$defs": {"N": {"$anchor": "N"}}, "properties": {}},
            "anchors",
        ),
        ({"type": "object", "properties": {"a": {"$id": "x", "type": "string"}}}, "'$id'"),
        ({"type": "object", "properties": {"a": {"$dynamicRef": "#x"}}}, "$dynamicRef"),
        ({"type": "array"}, "object schema"),
    ],
)
def test_what_the_grammar_cannot_follow_is_refused(schema: dict, words: str):
    with pytest.raises(ToolSchemaError, match=None) as info:
        checked_parameters(schema)
    assert words in str(info.value)
