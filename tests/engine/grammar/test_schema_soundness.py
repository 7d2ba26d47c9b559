"""Each JSON-schema verdict of engine/grammar/json_schema_rules.py, decided against a validator.

Soundness: for every schema the engine accepts, every string its grammar (built as the engine
builds it: ``enforceable_schema`` then ``json_schema_grammar``) admits must be valid JSON that
the ``jsonschema`` validator accepts against the schema the client sent. Two sources of strings:
the probes of each case (edge cases, valid and invalid), and random walks through the grammar
over a small vocabulary (ASCII bytes, control characters included, some multi-byte characters
and JSON escapes) that stop with probability 0.3 whenever the grammar may end. The grammar must
also admit some of the valid probes, so a case cannot pass by admitting nothing.

Refusals: every refused case names its keyword and path, and carries a witness that the plain
xgrammar grammar of the schema admits although the validator rejects it (or xgrammar cannot
compile the schema at all), so each refusal is needed with the installed xgrammar. Formats that
no installed checker can decide are listed apart (``UNCHECKED_FORMATS``).

``jsonschema`` checks ``date-time`` and ``time`` only with the optional ``rfc3339-validator``;
without it they are checked here by that package's rule: RFC 3339's syntax, ranged fields, and
the calendar date through jsonschema's own ``date`` checker.
"""

from __future__ import annotations

import enum
import itertools
import json
import random
import re
import uuid
from datetime import date, datetime, time
from typing import Annotated, Any, Literal

import jsonschema
import pytest
import xgrammar
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from paged_serve.engine.grammar.json_schema_rules import (
    ENFORCED_FORMATS,
    ENFORCED_KEYWORDS,
    FORMAT_PATTERNS,
    REFUSED_FORMATS,
    REFUSED_KEYWORDS,
)
from paged_serve.engine.grammar.structured_output import StructuredOutput, json_schema_grammar

# ------------------------------------------------------------------ the validator
FORMATS = jsonschema.FormatChecker()
_RFC3339_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
_RFC3339 = re.compile(rf"(\d{{4}}-\d{{2}}-\d{{2}})[Tt]{_RFC3339_TIME}", re.ASCII)
if "date-time" not in FORMATS.checkers:

    @FORMATS.checks("date-time")
    def _is_datetime(instance: object) -> bool:
        if not isinstance(instance, str):
            return True
        match = _RFC3339.fullmatch(instance)
        if match is None or not FORMATS.conforms(match[1], "date"):
            return False
        hour, minute, second = int(match[2]), int(match[3]), int(match[4])
        offset = (int(match[7]), int(match[8])) if match[7] else (0, 0)
        return hour <= 23 and minute <= 59 and second <= 60 and offset <= (23, 59)

    @FORMATS.checks("time")
    def _is_time(instance: object) -> bool:
        return not isinstance(instance, str) or _is_datetime("1970-01-01T" + instance)


def validates(schema: Any, text: str) -> bool:
    """Whether ``text`` is strict JSON that validates against ``schema`` (its own draft)."""
    try:
        instance = json.loads(text)
    except ValueError:
        return False
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=FORMATS).is_valid(instance)


# ------------------------------------------------------------------ random walks
_MULTI = ["é", "😀", "٣", "\u00a0", "\u2028", "\ufeff", "漢", "\u0085"]
_ESCAPES = ["\\u0041", "\\ud83d\\ude00", "\\n", '\\"', "\\\\", "1e5", "E-3", "-0", "\\u0061"]
VOCAB = [bytes([b]) for b in range(128)] + [t.encode() for t in _MULTI + _ESCAPES] + [b"<end>"]
END = len(VOCAB) - 1
_COMPILER = xgrammar.GrammarCompiler(
    xgrammar.TokenizerInfo(VOCAB, xgrammar.VocabType.RAW, stop_token_ids=[END]),
    cache_enabled=False,
)
WALKS = 60
MAX_WALK_TOKENS = 160


def walks(grammar: xgrammar.Grammar, *, seed: int, max_tokens: int = MAX_WALK_TOKENS) -> list[str]:
    """Strings the grammar admits, from random walks (those that end within ``max_tokens``)."""
    compiled = _COMPILER.compile_grammar(grammar)
    rng = random.Random(seed)
    mask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    done = []
    for _ in range(WALKS):
        matcher = xgrammar.GrammarMatcher(compiled)
        tokens: list[int] = []
        while len(tokens) < max_tokens:
            matcher.fill_next_token_bitmask(mask)
            words = mask[0].tolist()  # bit t % 32 of word t // 32 allows token t
            allowed = [t for t in range(len(VOCAB)) if (words[t >> 5] >> (t & 31)) & 1]
            if END in allowed and (allowed == [END] or rng.random() < 0.3):
                done.append(b"".join(VOCAB[t] for t in tokens).decode())
                break
            token = rng.choice([t for t in allowed if t != END])
            assert matcher.accept_token(token)
            tokens.append(token)
    return done


def engine_grammar(schema: Any) -> xgrammar.Grammar:
    """The grammar the engine compiles for ``schema`` (raises ValueError if it refuses it)."""
    return json_schema_grammar(StructuredOutput.json_schema(schema).spec)


def raw_grammar(schema: Any) -> xgrammar.Grammar:
    """xgrammar's own grammar for ``schema``, with the engine's settings and no guard."""
    return xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def assert_sound(schema: Any, valid: list[str], invalid: list[str], seed: int = 0) -> None:
    for text in valid:
        assert validates(schema, text), f"the table is wrong: {text!r} is not valid"
    for text in invalid:
        assert not validates(schema, text), f"the table is wrong: {text!r} is valid"
    grammar = engine_grammar(schema)
    admitted = [t for t in valid + invalid if grammar_accepts(grammar, t)]
    assert any(t in admitted for t in valid), "the grammar admits none of the valid probes"
    walked = walks(grammar, seed=seed)
    assert walked, "no random walk ended"
    wrong = [t for t in admitted + walked if not validates(schema, t)]
    assert not wrong, f"the grammar admits strings the schema rejects: {wrong[:5]}"


# ------------------------------------------------------------ enforced: (schema, valid, invalid)
S = {"type": "string"}
CTRL = '"a\x01b"'  # a raw control character: not JSON
ENFORCED = {
    # types, enum, const
    "string": (S, ['"a"', '"\\u0041"'], ['"a\tb"', CTRL, "1"]),
    "integer": ({"type": "integer"}, ["3", "-0", "12345678901234567890"], ["3.5", '"3"']),
    "number": ({"type": "number"}, ["1.5", "-2e3", "0"], ['"1"', "null"]),
    "boolean": ({"type": "boolean"}, ["true", "false"], ["0"]),
    "null": ({"type": "null"}, ["null"], ["0"]),
    "type list": (
        {"type": ["string", "null"], "maxLength": 3},
        ['"abc"', "null"],
        ['"abcd"', CTRL, "1"],
    ),
    "enum": (
        {"enum": [1, "a", None, True, {"b": [2]}]},
        ["1", '"a"', "null", "true", '{"b": [2]}'],
        ["2", "false", '{"b": [3]}'],
    ),
    "enum with type": ({"enum": ["red", 3], "type": "string"}, ['"red"'], ["3"]),
    "const": ({"const": {"a": [1, 2]}}, ['{"a":[1,2]}', '{"a": [1, 2]}'], ['{"a":[1]}']),
    "const with type": ({"const": "x", "type": "string"}, ['"x"'], ['"y"']),
    # strings
    "lengths": (
        {"type": "string", "minLength": 2, "maxLength": 4},
        ['"ab"', '"abcd"', '"😀é"'],
        ['"a"', '"abcde"', CTRL, '"a\nb"'],
    ),
    "lengths without type": ({"minLength": 3}, ['"abc"', "1"], ['"a"']),
    "pattern": (
        {"type": "string", "pattern": "^\\d{3}-[A-Z]{2}$"},
        ['"123-AB"'],
        ['"12-AB"', '"123-ab"', '"123-AB-"'],
    ),
    "pattern unanchored": ({"type": "string", "pattern": "a|b"}, ['"a"', '"b"', '"xa"'], ['"x"']),
    "pattern alternatives": (
        {"type": "string", "pattern": "^a$|^b+$"},
        ['"a"', '"bb"'],
        ['"ab"', '"c"'],
    ),
    "pattern classes": (
        {"type": "string", "pattern": "^[a-z]+(?:-[a-z0-9_]+)*\\.?\\w*$"},
        ['"ab-c1.x"', '"ab"'],
        ['"-a"', '"a b"'],
    ),
    "pattern negated class": (
        {"type": "string", "pattern": '^[^"\\\\]{0,8}$'},
        ['"abc"', '"a b"'],
        ['"a\\"b"', CTRL],
    ),
    "pattern any character": (
        {"type": "string", "pattern": "^.{2}$"},
        ['"ab"', '"😀x"'],
        ['"a\\nb"', '"abc"'],
    ),
    "pattern optional group": (
        {"type": "string", "pattern": "^a(?:xb+)?c$"},
        ['"ac"', '"axbbc"'],
        ['"abc"', '"axc"'],
    ),
    "pattern semver": (
        {"type": "string", "pattern": "^\\d+\\.\\d+\\.\\d+(?:-[0-9A-Za-z.]+)?$"},
        ['"1.2.3"', '"1.2.3-rc.1"'],
        ['"1.2.3rc1"', '"1.2"'],
    ),
    "pattern escapes": (
        {"type": "string", "pattern": "^\\x41\\u00e9\\.\\/$"},
        ['"Aé./"'],
        ['"Ae./"'],
    ),
    "format email": ({"type": "string", "format": "email"}, ['"a@b.co"'], ['"ab"']),
    "format ipv6": ({"type": "string", "format": "ipv6"}, ['"::1"', '"fe80::1"'], ['"1.2.3.4"']),
    "format uuid": (
        {"type": "string", "format": "uuid"},
        ['"123e4567-e89b-12d3-a456-426614174000"'],
        ['"123e4567"'],
    ),
    "format json-pointer": ({"type": "string", "format": "json-pointer"}, ['"/a/b"'], ['"a"']),
    "format date": (
        {"type": "string", "format": "date"},
        ['"2024-02-29"', '"2000-02-29"', '"0001-01-01"', '"2021-12-31"'],
        ['"2023-02-29"', '"1900-02-29"', '"2021-04-31"', '"0000-01-01"', '"2021-13-01"'],
    ),
    "format date-time": (
        {"type": "string", "format": "date-time"},
        ['"2024-02-29T23:59:59.5+05:30"', '"2021-01-01T00:00:00Z"'],
        ['"2021-02-30T00:00:00Z"', '"2021-01-01T24:00:00Z"', '"2021-01-01T00:00:00"'],
    ),
    "format time": (
        {"type": "string", "format": "time"},
        ['"23:59:59Z"', '"00:00:00.123-01:00"'],
        ['"24:00:00Z"', '"12:00:00"', '"12:60:00Z"'],
    ),
    "format ipv4": (
        {"type": "string", "format": "ipv4"},
        ['"1.2.3.4"', '"255.255.255.255"', '"0.0.0.0"'],
        ['"01.2.3.4"', '"256.1.1.1"', '"1.2.3"'],
    ),
    "format date nullable": (
        {"type": ["string", "null"], "format": "date"},
        ['"2024-01-31"', "null"],
        ['"2024-02-30"'],
    ),
    "format unknown": ({"type": "string", "format": "password"}, ['"x"'], ["1"]),
    # numbers
    "integer range": (
        {"type": "integer", "minimum": -5, "maximum": 5},
        ["-5", "0", "5"],
        ["6", "-6", "1e400"],
    ),
    "integer exclusive": (
        {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        ["-4", "4"],
        ["-5", "5"],
    ),
    "number range": (
        {"type": "number", "minimum": 0.5, "maximum": 1.5},
        ["0.5", "1.5", "1"],
        ["0.49", "1.51", "2"],
    ),
    "number exclusive": (
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        ["0.5"],
        ["0", "1", "-0"],
    ),
    "number maximum": ({"type": "number", "maximum": 5}, ["4.99", "-3"], ["6", "1e400"]),
    "range without type": ({"minimum": 3}, ["3", "4.5", '"a"'], ["2", "-1e400"]),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, ["0", "-3", "9"], ["4"]),
    "multipleOf largest": ({"type": "integer", "multipleOf": 1024}, ["2048"], ["1023"]),
    # arrays
    "items and counts": (
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
        ["[true, false]", "[true, true, true]"],
        ["[true]", "[true, true, true, true]", "[1, 2]"],
    ),
    "prefixItems": (
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
            "items": False,
        },
        ['[1, "ab"]'],
        ['[1, "abc"]', '[1, "ab", 3]', '[1, "\x01"]'],
    ),
    "counts without type": ({"maxItems": 1}, ["[]", "[1]", "3"], ["[1, 2]"]),
    "uniqueItems false": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 2},
        ["[1, 1]"],
        ["[1, 2, 3]"],
    ),
    # objects
    "properties": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 2}},
            "required": ["a"],
            "additionalProperties": False,
        },
        ['{"a": 1}', '{"a": 1, "b": "xy"}'],
        ['{"a": 1, "c": 2}', '{"b": "x"}', '{"a": 1, "b": "xyz"}', '{"a": 1, "b": "\t"}'],
    ),
    "property true": ({"type": "object", "properties": {"a": True}}, ['{"a": [1]}', "{}"], []),
    "required without properties": (
        {"type": "object", "required": ["name", "age"]},
        ['{"name": "x", "age": 3}'],
        ["{}", '{"name": "x"}'],
    ),
    "required not listed": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        ['{"a": 1, "b": null}'],
        ['{"a": 1}', '{"b": 1}'],
    ),
    "required without type": ({"required": ["a"]}, ['{"a": 1}', "3"], ["{}"]),
    "property counts": (
        {
            "type": "object",
            "properties": {"a": {"type": "null"}, "b": {"type": "null"}, "c": {"type": "null"}},
            "minProperties": 1,
            "maxProperties": 2,
        },
        ['{"a": null}', '{"a": null, "c": null}'],
        ["{}", '{"a": null, "b": null, "c": null}'],
    ),
    "map": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
        ["{}", '{"x": 1}', '{"x": 1, "x": 2}'],
        ['{"x": "s"}', '{"x": 1, "y": 2, "z": 3}'],
    ),
    "propertyNames pattern": (
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-c]+$"},
            "additionalProperties": {"type": "null"},
        },
        ['{"ab": null}', "{}"],
        ['{"zz": null}'],
    ),
    "propertyNames lengths": (
        {
            "type": "object",
            "propertyNames": {"maxLength": 2},
            "additionalProperties": {"type": "null"},
        },
        ['{"ab": null}', "{}"],
        ['{"abc": null}', '{"\x01": null}'],
    ),
    "patternProperties": (
        {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        ['{"a": "s"}', "{}", '{"x": 1}'],
        ['{"x": "s"}', '{"y": 1}'],
    ),
    # combinators
    "anyOf": (
        {"anyOf": [{"type": "integer", "minimum": 3}, {"type": "string", "maxLength": 1}]},
        ["3", '"a"'],
        ["2", '"ab"', '"\x00"'],
    ),
    "oneOf of types": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, ["1", '"a"'], ["1.5"]),
    "oneOf discriminated": (
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["kind", "x"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
                    "required": ["kind", "y"],
                    "additionalProperties": False,
                },
            ]
        },
        ['{"kind": "a", "x": 1}', '{"kind": "b", "y": "s"}'],
        ['{"kind": "a", "y": "s"}'],
    ),
    "allOf single": (
        {"allOf": [{"type": "string", "maxLength": 2}]},
        ['"ab"'],
        ['"abc"', '"\x0b"'],
    ),
    "$ref": (
        {
            "$defs": {"s": {"type": "string", "maxLength": 2}},
            "type": "object",
            "properties": {"v": {"$ref": "#/$defs/s"}},
            "required": ["v"],
            "additionalProperties": False,
        },
        ['{"v": "ab"}'],
        ['{"v": "abc"}', '{"v": 1}'],
    ),
    "$ref recursive": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}
                    },
                    "required": ["kids"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        ['{"kids": []}', '{"kids": [{"kids": []}]}'],
        ["{}", '{"kids": [{}]}'],
    ),
    "annotations": (
        {"type": "string", "title": "t", "description": "d", "default": "x", "examples": ["a"]},
        ['"a"'],
        ["1"],
    ),
}


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_an_accepted_schema_holds(name: str):
    schema, valid, invalid = ENFORCED[name]
    assert_sound(schema, valid, invalid)


# ------------------------------------------------------- refused: (schema, keyword, path, witness)
RAW_ERROR = object()  # xgrammar itself cannot compile the schema
_DRAFT7 = "http://json-schema.org/draft-07/schema#"
_DRAFT2019 = "https://json-schema.org/draft/2019-09/schema"
REFUSED = {
    "pattern with maxLength": (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "maxLength",
        "schema",
        '"abcdef"',
    ),
    "pattern with minLength": (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 12},
        "minLength",
        "schema",
        '"ab"',
    ),
    "format with maxLength": (
        {"type": "string", "format": "email", "maxLength": 5},
        "maxLength",
        "schema",
        '"abc@de.fg"',
    ),
    "format with pattern": (
        {"type": "string", "format": "date", "pattern": "^2"},
        "format",
        "schema",
        '"1999-01-01"',
    ),
    "format idn-email": ({"type": "string", "format": "idn-email"}, "format", "schema", '"ab"'),
    "format idn-hostname": (
        {"type": "string", "format": "idn-hostname"},
        "format",
        "schema",
        '"a b"',
    ),
    "format regex": ({"type": "string", "format": "regex"}, "format", "schema", '"("'),
    "format relative-json-pointer": (
        {"type": "string", "format": "relative-json-pointer"},
        "format",
        "schema",
        '"109"',
    ),
    "pattern lookahead": (
        {"type": "string", "pattern": "^(?=a)[ab]$"},
        "pattern",
        "schema",
        '"b"',
    ),
    "pattern anchor inside": ({"type": "string", "pattern": "a$b"}, "pattern", "schema", '"ab"'),
    "pattern anchor in a group": (
        {"type": "string", "pattern": "x(^b)"},
        "pattern",
        "schema",
        '"xb"',
    ),
    "pattern anchor after an escaped bar": (
        {"type": "string", "pattern": "a\\|^b"},
        "pattern",
        "schema",
        '"a|b"',
    ),
    "pattern unicode spaces": (
        {"type": "string", "pattern": "^\\s$"},
        "pattern",
        "schema",
        '"\ufeff"',
    ),
    "pattern non-space": ({"type": "string", "pattern": "^\\S$"}, "pattern", "schema", '"\x85"'),
    "pattern non-digit": ({"type": "string", "pattern": "^\\D$"}, "pattern", "schema", '"٣"'),
    "pattern non-word": ({"type": "string", "pattern": "^\\W$"}, "pattern", "schema", '"é"'),
    "pattern negated digit": (
        {"type": "string", "pattern": "^[^\\d]$"},
        "pattern",
        "schema",
        '"٣"',
    ),
    "pattern brace": ({"type": "string", "pattern": "^a{,2}$"}, "pattern", "schema", RAW_ERROR),
    "open object beside properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        "additionalProperties",
        "schema",
        '{"a": 1, "\\u0061": "x"}',
    ),
    "open map with required": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "required": ["k"]},
        "additionalProperties",
        "schema",
        "{}",
    ),
    "minProperties with repeatable keys": (
        {"type": "object", "additionalProperties": True, "minProperties": 2},
        "minProperties",
        "schema",
        '{"b": 1, "b": 2}',
    ),
    "propertyNames beside properties": (
        {
            "type": "object",
            "properties": {"zz": {"type": "integer"}},
            "propertyNames": {"pattern": "^[a-c]+$"},
        },
        "propertyNames",
        "schema",
        '{"zz": 1}',
    ),
    "patternProperties matching a property": (
        {
            "type": "object",
            "properties": {"xb": {"type": "string"}},
            "patternProperties": {"^x": {"type": "integer"}},
        },
        "patternProperties",
        "schema",
        '{"xb": "s"}',
    ),
    "required never allowed": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "required",
        "schema",
        '{"a": 1}',
    ),
    "required only by pattern": (
        {"type": "object", "patternProperties": {"^b": {"type": "integer"}}, "required": ["b"]},
        "required",
        "schema",
        "{}",
    ),
    "enum with maxLength": (
        {"enum": ["abcdef", 3], "maxLength": 3},
        "maxLength",
        "schema",
        '"abcdef"',
    ),
    "enum of another type": ({"enum": ["a"], "type": "integer"}, "enum", "schema", '"a"'),
    "const of another type": (
        {"const": "abcdef", "type": "integer"},
        "const",
        "schema",
        '"abcdef"',
    ),
    "beside anyOf": (
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "maxLength": 1},
        "maxLength",
        "schema",
        '"abc"',
    ),
    "type beside anyOf": (
        {"type": "integer", "anyOf": [{"minimum": 2}]},
        "type",
        "schema",
        '"abc"',
    ),
    "beside allOf": (
        {"allOf": [{"type": "string"}], "maxLength": 2},
        "maxLength",
        "schema",
        '"abc"',
    ),
    "beside $ref": (
        {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2},
        "maxLength",
        "schema",
        '"abc"',
    ),
    "allOf of two": (
        {"allOf": [{"type": "integer"}, {"minimum": 3}]},
        "allOf",
        "schema",
        "1",
    ),
    "oneOf overlapping": (
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        "oneOf",
        "schema",
        "3",
    ),
    "multipleOf with a range": (
        {"type": "integer", "multipleOf": 3, "minimum": 1},
        "multipleOf",
        "schema",
        "4",
    ),
    "multipleOf too large": (
        {"type": "integer", "multipleOf": 1025},
        "multipleOf",
        "schema",
        "1",
    ),
    "multipleOf on numbers": (
        {"type": "number", "multipleOf": 0.5},
        "multipleOf",
        "schema",
        "0.3",
    ),
    "multipleOf fractional": (
        {"type": "integer", "multipleOf": 2.5},
        "multipleOf",
        "schema",
        "4",
    ),
    "uniqueItems": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "uniqueItems",
        "schema",
        "[1, 1]",
    ),
    "items list": (
        {"type": "array", "items": [{"type": "integer"}]},
        "items",
        "schema",
        RAW_ERROR,
    ),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, "contains", "schema", "[]"),
    "minContains": (
        {"type": "array", "contains": {"type": "integer"}, "minContains": 1, "maxContains": 2},
        "contains",
        "schema",
        RAW_ERROR,
    ),
    "not": ({"not": {"type": "string"}}, "not", "schema", '"a"'),
    "if then else": (
        {"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}},
        "if",
        "schema",
        "1",
    ),
    "dependentRequired": (
        {"type": "object", "additionalProperties": True, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        "schema",
        '{"a": 1}',
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "additionalProperties": True,
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        "dependentSchemas",
        "schema",
        '{"a": 1}',
    ),
    "dependencies": (
        {
            "$schema": _DRAFT7,
            "type": "object",
            "additionalProperties": True,
            "dependencies": {"a": ["b"]},
        },
        "dependencies",
        "schema",
        '{"a": 1}',
    ),
    "additionalItems": (
        {
            "$schema": _DRAFT7,
            "type": "array",
            "items": [{"type": "integer"}],
            "additionalItems": False,
        },
        "additionalItems",
        "schema",
        RAW_ERROR,
    ),  # fmt: skip
    "unevaluatedProperties": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "unevaluatedProperties": {"type": "string"},
        },
        "unevaluatedProperties",
        "schema",
        '{"a": 1, "\\u0061": "x"}',
    ),
    "$dynamicRef": (
        {
            "$defs": {"s": {"$dynamicAnchor": "s", "type": "string"}},
            "type": "object",
            "properties": {"v": {"$dynamicRef": "#s"}},
            "required": ["v"],
            "additionalProperties": False,
        },
        "$dynamicRef",
        "schema.properties.v",
        '{"v": 1}',
    ),
    "$recursiveRef": (
        {
            "$schema": _DRAFT2019,
            "type": "object",
            "properties": {"v": {"$recursiveRef": "#"}},
            "additionalProperties": False,
        },
        "$recursiveRef",
        "schema.properties.v",
        '{"v": 1}',
    ),
    "nested path": (
        {"type": "object", "properties": {"a": {"type": "array", "items": {"not": S}}}},
        "not",
        "schema.properties.a.items",
        '{"a": ["s"]}',
    ),
}
# Refused, yet no witness: with strict mode xgrammar closes arrays past their prefixItems, so
# ``unevaluatedItems`` may hold; it is refused rather than proven.
REFUSED_UNPROVEN = {
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
        "unevaluatedItems",
        "schema",
    ),
}
# Formats of the standard that no installed checker decides: refused, since no test can show
# that xgrammar enforces them exactly.
CHECKED_REFUSED_FORMATS = {"idn-email", "idn-hostname", "regex", "relative-json-pointer"}
UNCHECKED_FORMATS = REFUSED_FORMATS - CHECKED_REFUSED_FORMATS


def assert_refused(schema: Any, keyword: str, path: str) -> None:
    with pytest.raises(ValueError) as caught:
        StructuredOutput.json_schema(schema)
    assert f"unsupported JSON schema keyword {keyword!r} at {path}:" in str(caught.value)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_schema_is_named_and_would_be_violated(name: str):
    schema, keyword, path, witness = REFUSED[name]
    assert_refused(schema, keyword, path)
    if witness is RAW_ERROR:
        with pytest.raises(RuntimeError):
            raw_grammar(schema)
        return
    assert not validates(schema, witness), f"the table is wrong: {witness!r} is valid"
    assert grammar_accepts(raw_grammar(schema), witness), (
        f"xgrammar now rejects {witness!r}: decide {keyword!r} again (it may be enforced)"
    )


@pytest.mark.parametrize("name", sorted(REFUSED_UNPROVEN))
def test_a_keyword_refused_without_witness_is_named(name: str):
    assert_refused(*REFUSED_UNPROVEN[name])


@pytest.mark.parametrize("fmt", sorted(UNCHECKED_FORMATS))
def test_a_format_nothing_checks_is_refused(fmt: str):
    assert fmt not in FORMATS.checkers, f"{fmt!r} is checkable now: decide it by a case"
    assert_refused({"type": "string", "format": fmt}, "format", "schema")


# ------------------------------------------------------------------ every keyword has a verdict
def _validator_keywords() -> set[str]:
    drafts = (
        jsonschema.Draft4Validator,
        jsonschema.Draft6Validator,
        jsonschema.Draft7Validator,
        jsonschema.Draft201909Validator,
        jsonschema.Draft202012Validator,
    )
    return {keyword for draft in drafts for keyword in draft.VALIDATORS}


def _keywords_in(schema: Any) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(_keywords_in, schema))
    if not isinstance(schema, dict):
        return set()
    return set(schema) | set().union(*map(_keywords_in, schema.values()))


def test_every_keyword_the_validator_knows_has_a_tested_verdict():
    known = _validator_keywords()
    assert known - {"$schema"} <= ENFORCED_KEYWORDS | REFUSED_KEYWORDS
    assert not ENFORCED_KEYWORDS & REFUSED_KEYWORDS
    enforced_cases = _keywords_in([case[0] for case in ENFORCED.values()])
    assert ENFORCED_KEYWORDS <= enforced_cases, ENFORCED_KEYWORDS - enforced_cases
    refused = [*REFUSED.values(), *REFUSED_UNPROVEN.values()]
    refused_cases = _keywords_in([case[0] for case in refused])
    assert REFUSED_KEYWORDS <= refused_cases, REFUSED_KEYWORDS - refused_cases


def test_every_format_the_validator_checks_has_a_tested_verdict():
    decided = ENFORCED_FORMATS | FORMAT_PATTERNS.keys() | REFUSED_FORMATS
    assert set(FORMATS.checkers) - {"color"} <= decided  # color: draft 3 only
    tested = {case[0].get("format") for case in ENFORCED.values()}
    assert ENFORCED_FORMATS | FORMAT_PATTERNS.keys() <= tested
    assert ENFORCED_FORMATS | FORMAT_PATTERNS.keys() <= set(FORMATS.checkers)
    refused = {case[0].get("format") for case in REFUSED.values()} | UNCHECKED_FORMATS
    assert REFUSED_FORMATS <= refused


# ------------------------------------------------------------------ what clients send
class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: Annotated[str, Field(pattern=r"^\d{5}$")]


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    name: str


class Person(BaseModel):
    name: str = Field(max_length=24, min_length=1)
    nickname: str | None = None
    note: Annotated[str | None, Field(max_length=8)] = None
    colour: Colour
    level: Level = Level.LOW
    tags: list[str] = Field(default_factory=list, max_length=3)
    scores: dict[str, int] = {}
    address: Address
    previous: list[Address] = []
    pet: Cat | Dog = Field(discriminator="pet_type")
    pair: tuple[int, str]
    born: date
    seen: datetime
    wakes: time
    key: uuid.UUID
    ratio: float = Field(gt=0, lt=1)


def test_pydantic_models_are_accepted_and_hold():
    schema = Person.model_json_schema()
    grammar = engine_grammar(schema)
    for seed in range(3):
        walked = walks(grammar, seed=seed, max_tokens=4000)
        assert walked, "no random walk ended"
        wrong = [t for t in walked if not validates(schema, t)]
        assert not wrong, wrong[:3]


# ------------------------------------------------------------------ patterns, differentially
def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    """A random expression over ``a b x``: classes, groups, alternatives, every quantifier."""
    pieces = []
    for _ in range(rng.randint(1, 3)):
        if depth < 2 and rng.random() < 0.4:
            alternatives = [_random_pattern(rng, depth + 1) for _ in range(rng.choice((1, 1, 2)))]
            atom = "(?:" + "|".join(alternatives) + ")"
        else:
            atom = rng.choice(("a", "b", "x", "[ab]", "[^a]", "."))
        pieces.append(atom + rng.choice(("", "", "?", "*", "+", "{0,1}", "{1,2}", "{2}", "??")))
    return "".join(pieces)


_SHORT_STRINGS = ["".join(s) for n in range(5) for s in itertools.product("abx", repeat=n)]


@pytest.mark.parametrize("seed", range(4))
def test_random_patterns_admit_only_what_they_match(seed: int):
    """xgrammar 0.2.9 drops parts of an optional group that holds a quantifier; the engine's
    pattern must admit only strings the whole expression matches (Python's ``re``)."""
    rng = random.Random(seed)
    for _ in range(40):
        body = _random_pattern(rng)
        schema = {"type": "string", "pattern": f"^{body}$"}
        grammar = engine_grammar(schema)
        wrong = [
            s for s in _SHORT_STRINGS
            if grammar_accepts(grammar, json.dumps(s)) and not re.fullmatch(body, s)
        ]  # fmt: skip
        assert not wrong, f"{body!r} admits {wrong[:3]}"
