"""One way from a request's tools to the JSON schema that ``tool_choice`` holds the reply to.

Every tool's ``parameters`` schema moves, whole, under the root's ``$defs`` (``tool_0``,
``tool_1``, ...) and each of its local references moves with it, so a schema that refers to its
own ``$defs``, ``definitions`` or to itself (a recursive tree) means the same thing wherever the
call is embedded::

    tools[0].parameters = {"$defs": {"Opt": {...}}, "properties": {"o": {"$ref": "#/$defs/Opt"}}}
    root = {"$defs": {"tool_0": {..., "properties": {"o": {"$ref": "#/$defs/tool_0/$defs/Opt"}}}},
            <the choice's shape, which names each tool as {"$ref": "#/$defs/tool_0"}>}

The three shapes built on it (``named``, ``required``, the generic ``envelope`` of ``auto``) so
resolve references alike. A reference the grammar library could not follow the same way (another
document, an ``$anchor`` name, a pointer to nothing, an ``$id`` below the root) is refused with
the tool's field and the keyword's path, never left for the compiler to misread.
"""

from __future__ import annotations

import copy
from typing import Any

from paged_serve.engine.grammar.structured_output import StructuredOutput, subschemas

JsonObject = dict[str, Any]


class ToolSchemaError(ValueError):
    """A tool's parameters cannot be held by the grammar; the message names the keyword."""


def checked_parameters(schema: JsonObject | None) -> JsonObject:
    """The tool's parameter schema (an empty object schema if absent), checked for keywords we
    cannot enforce and references we cannot follow. Raises ToolSchemaError."""
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ToolSchemaError("a function's parameters must be an object schema")
    try:
        StructuredOutput.json_schema(schema)
    except ValueError as exc:
        raise ToolSchemaError(str(exc)) from None
    _relocated(schema, "#/$defs/tool_0")  # the references are checked where they are moved
    return schema


class ToolGrammar:
    """The tools' parameter schemas under one root ``$defs``; builds each choice's schema."""

    def __init__(self, parameters: dict[str, JsonObject]):
        """``parameters``: each tool's checked schema (``checked_parameters``), by name, in the
        request's order."""
        self._keys = {name: f"tool_{i}" for i, name in enumerate(parameters)}
        self._defs = {
            self._keys[name]: _relocated(schema, f"#/$defs/{self._keys[name]}")
            for name, schema in parameters.items()
        }

    def named(self, name: str) -> StructuredOutput:
        """The reply is ``name``'s arguments object."""
        key = self._keys[name]
        return _schema({"$defs": {key: self._defs[key]}, "$ref": f"#/$defs/{key}"})

    def required(self, parallel: bool) -> StructuredOutput:
        """The reply is a JSON list of one call (``parallel`` False) or more."""
        schema: JsonObject = {"type": "array", "items": self._any_call(), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return _schema({"$defs": self._defs, **schema})

    def envelope(self, parallel: bool) -> StructuredOutput:
        """The generic ``auto`` reply of a model without tool support (after llama.cpp's
        server): ``{"tool_calls": [call, ...]}`` (``{"tool_call": call}`` without parallel
        calls) or ``{"response": "text"}``."""
        if parallel:
            listed = {"type": "array", "items": self._any_call(), "minItems": 1}
            calls: JsonObject = {"tool_calls": listed}
        else:
            calls = {"tool_call": self._any_call()}
        shapes = [_closed_object(calls), _closed_object({"response": {"type": "string"}})]
        return _schema({"$defs": self._defs, "anyOf": shapes})

    def _any_call(self) -> JsonObject:
        calls = [
            _closed_object({"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{key}"}})
            for name, key in self._keys.items()
        ]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _closed_object(properties: JsonObject) -> JsonObject:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _schema(schema: JsonObject) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(schema)
    except ValueError as exc:  # e.g. over the size limit once every tool is in one schema
        raise ToolSchemaError(str(exc)) from None


def _relocated(schema: JsonObject, base: str) -> JsonObject:
    """A copy of ``schema`` whose local references point where it will sit (``base``).

    Raises ToolSchemaError for a reference that is not a JSON pointer into ``schema`` itself.
    """
    moved = copy.deepcopy(schema)
    moved.pop("$schema", None)  # a draft marker means nothing inside another schema
    moved.pop("$id", None)  # the root's own id: its fragment references stay local
    for path, node in subschemas(moved):
        if path != "schema" and "$id" in node:
            raise ToolSchemaError(
                f"'$id' at {path} is not supported: it would change what references below mean"
            )
        if "$anchor" in node or "$dynamicAnchor" in node:
            raise ToolSchemaError(f"anchors are not supported (at {path}); use '#/$defs/...'")
        ref = node.get("$ref")
        if ref is None:
            continue
        if not isinstance(ref, str) or not ref.startswith("#") or ref[1:2] not in ("", "/"):
            raise ToolSchemaError(
                f"$ref {ref!r} at {path} is not supported: only references into the tool's own "
                "schema ('#', '#/$defs/Name', '#/definitions/Name') are"
            )
        if not _resolves(schema, ref[1:]):
            raise ToolSchemaError(f"$ref {ref!r} at {path} points at nothing in the schema")
        node["$ref"] = base + ref[1:]
    return moved


def _resolves(schema: Any, pointer: str) -> bool:
    """Whether the JSON pointer (``/a/b``, RFC 6901 escapes) names a value in ``schema``."""
    node = schema
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdecimal() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True
