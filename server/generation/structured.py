"""Structured outputs: the request fields that constrain a reply
(``paged_serve.server.protocol.structured``), as one
``paged_serve.engine.grammar.structured_output.StructuredOutput``.

Accepted forms (at most one per request; the engine guarantees the output matches it):

* OpenAI ``response_format`` (chat and completions): ``{"type": "text"}``, ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* OpenAI Responses ``text.format``: the same types, with ``name``/``schema``/``strict`` flat;
* vLLM's ``structured_outputs`` extra: exactly one of ``json`` (a schema, object or text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or ``json_object: true``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

A malformed or unsupported constraint is a 400 naming the field; compiling it (which can take a
while for a large schema) runs off the event loop, within the engine's budget, before the
request is queued (engine/grammar/compiles.py), so an invalid or too costly grammar is refused
before any work and the engine thread only ever meets a cached grammar.
"""

from __future__ import annotations

from typing import Any

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.compiles import CompileQueueFullError
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.protocol.errors import bad_request, queue_full
from paged_serve.server.protocol.sampling import SamplingFields
from paged_serve.server.protocol.structured import (
    JsonSchema,
    ResponseFormat,
    ResponseText,
    StructuredOutputsField,
)


def _build(param: str, make: Any, *args: Any) -> StructuredOutput:
    """``make(*args)``, with a ValueError (a bad schema, size, keyword) as a 400 on ``param``."""
    try:
        return make(*args)
    except ValueError as exc:
        raise bad_request(f"invalid {param}: {exc}", param) from None


def _typed(kind: str, schema: JsonSchema | None, param: str) -> StructuredOutput | None:
    """The constraint of a format ``type`` (``text``, ``json_object``, ``json_schema``)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        if schema is None:
            raise bad_request("a json_schema format needs its schema", param)
        return _build(param, StructuredOutput.json_schema, schema)
    raise bad_request(
        f"unsupported {param} type {kind!r}: use text, json_object or json_schema", param
    )


def from_response_format(fmt: ResponseFormat) -> StructuredOutput | None:
    spec = fmt.json_schema
    if fmt.type == "json_schema" and spec is None:
        raise bad_request("a json_schema response_format needs json_schema", "response_format")
    return _typed(fmt.type, spec.schema if spec else None, "response_format")


def from_text_format(text: ResponseText) -> StructuredOutput | None:
    fmt = text.format
    return None if fmt is None else _typed(fmt.type, fmt.schema, "text.format")


def from_structured_outputs(
    field: StructuredOutputsField, param: str = "structured_outputs"
) -> StructuredOutput:
    given = {
        name: value
        for name in ("json", "regex", "choice", "grammar", "json_object")
        if (value := getattr(field, name)) not in (None, False)
    }
    if len(given) != 1:
        raise bad_request(
            f"{param} needs exactly one of json, regex, choice, grammar, json_object", param
        )
    [(name, value)] = given.items()
    if name == "json":
        return _build(param, StructuredOutput.json_schema, value)
    if name == "json_object":
        return StructuredOutput("json_object")
    if name == "choice":
        return _build(param, lambda: StructuredOutput("choice", choices=tuple(value)))
    return _build(param, StructuredOutput, name, value)


def from_guided_fields(
    *,
    guided_json: JsonSchema | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> tuple[StructuredOutput, str] | None:
    """vLLM's older ``guided_*`` fields as (constraint, the field named); at most one."""
    given = [
        (name, value)
        for name, value in (
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
            ("guided_grammar", guided_grammar),
        )
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request("set at most one guided_* field", given[1][0])
    [(name, value)] = given
    field = StructuredOutputsField(**{name.removeprefix("guided_"): value})
    return from_structured_outputs(field, name), name


def request_constraint(body: SamplingFields) -> tuple[StructuredOutput, str] | None:
    """A completions or chat request's output constraint and the field that set it; a 400 when
    two fields set one."""
    found: list[tuple[StructuredOutput, str]] = []
    if body.response_format is not None:
        constraint = from_response_format(body.response_format)
        if constraint is not None:
            found.append((constraint, "response_format"))
    if body.structured_outputs is not None:
        found.append((from_structured_outputs(body.structured_outputs), "structured_outputs"))
    guided = from_guided_fields(
        guided_json=body.guided_json,
        guided_regex=body.guided_regex,
        guided_choice=body.guided_choice,
        guided_grammar=body.guided_grammar,
    )
    if guided is not None:
        found.append(guided)
    if len(found) > 1:
        raise bad_request(
            f"{found[0][1]} and {found[1][1]} both constrain the output: set one",
            found[1][1],
        )
    return found[0] if found else None


async def compile_constraint(engine: Any, params: SamplingParams, param: str) -> None:
    """Compile the output constraint of ``params``, if any, off the event loop and within the
    engine's budget (engine/grammar/compiles.py; the engine caches it): a grammar that does not
    compile, admits nothing or is too costly is a 400 on ``param``; a full compile queue is a
    503."""
    if params.structured_output is None:
        return
    try:
        await engine.compile_grammar(params.structured_output)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param) from None
    except CompileQueueFullError as exc:
        raise queue_full(exc) from None
