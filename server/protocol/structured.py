"""Structured outputs on the wire: the request fields that constrain a reply.

Accepted forms (at most one per request):

* OpenAI ``response_format`` (chat and completions): ``{"type": "text"}``, ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* OpenAI Responses ``text.format``: the same types, with ``name``/``schema``/``strict`` flat;
* vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a schema, object or text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object: true``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  (fields of ``paged_serve.server.protocol.sampling.SamplingFields``).

How each becomes the engine's constraint is ``paged_serve.server.generation.structured``.
"""

from __future__ import annotations

from typing import Any

import msgspec

JsonSchema = dict[str, Any] | bool


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: ``schema`` is the JSON schema itself."""

    name: str | None = None
    description: str | None = None
    schema: JsonSchema | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's ``response_format``."""

    type: str
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs`` extra: set exactly one field."""

    json: JsonSchema | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields beside."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseText(msgspec.Struct, kw_only=True):
    """The Responses API's ``text`` field (its ``format`` has the json_schema fields flat)."""

    format: TextFormat | None = None
