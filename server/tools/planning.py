"""Chat tools: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, the
conversation with its tool calls and tool results as template messages, and what the reply is
constrained to and parsed with.

``plan_tools`` is the one entry point: it checks the request's tools and returns a ``ToolPlan``,
and a handler asks the plan for the rest (``conversation`` for the template's messages,
``constrain`` for the sampling params, ``reply`` or ``stream`` for the calls in the output).

A template that renders tools (its source mentions ``tools``) gets them through
``apply_chat_template(..., tools=...)`` and the model's own call format; one that does not (the
default SmolLM2's) gets a generic format, after llama.cpp's server: the tools described in a
system message, past calls and results as JSON, and the reply held to a JSON envelope.

``tool_choice``:

* ``none``: no tools in the prompt and no parsing;
* ``auto`` (the default with tools): native templates are parsed by their family's parser
  (``paged_serve.server.tools.parsers``); the generic format's reply is constrained to
  ``{"tool_call": ...}`` (``{"tool_calls": [...]}`` with parallel calls) or ``{"response": "..."}``;
* ``required`` and a named function: the grammar forces the reply to a JSON list of calls / the
  named function's arguments object, so the arguments match the tool's parameter schema by
  construction, whatever the model.

Every choice's grammar comes from one ``paged_serve.server.tools.grammar.ToolGrammar``, so a
schema with ``$defs``/``$ref`` means the same under each. A whole reply holds only the calls whose
JSON is whole (``paged_serve.server.tools.parsers``): a reply that ``max_tokens`` cuts off
mid-call ends with ``finish_reason: "length"``, the unfinished call as text in the content under
``auto``, and nothing of it under ``required`` and a named choice (empty content, an empty
``tool_calls`` list). A stream sends a call's argument fragments as the model writes them
(``paged_serve.server.tools.streaming``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.generation.prompts import ROLES, message_text
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.tools import (
    FunctionCall,
    JsonObject,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from paged_serve.server.tools.grammar import ToolGrammar, ToolSchemaError, checked_parameters
from paged_serve.server.tools.parsers import (
    PARSERS,
    FirstCallOnly,
    GenericParser,
    NamedParser,
    RequiredParser,
    ToolParser,
    parser_for_template,
)
from paged_serve.server.tools.streaming import ToolCallStream, new_call_id


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are rendered, constrained and parsed.

    tools: the tools for the template (None: none in the prompt); native: the template renders
    tools itself; parser: None when the reply is not parsed for calls; constraint: the grammar
    that tool_choice imposes (None: unconstrained)."""

    tools: list[JsonObject] | None
    native: bool
    parser: ToolParser | None
    constraint: StructuredOutput | None
    parallel: bool

    @property
    def forced(self) -> bool:
        """The reply must be calls (``required`` or a named function): it has no text."""
        return self.parser is not None and self.parser.forced

    @property
    def template_tools(self) -> list[JsonObject] | None:
        """The tools ``apply_chat_template`` gets: only a template that renders them does
        (the generic format describes them in a system message, ``conversation``)."""
        return self.tools if self.native else None

    def conversation(
        self, messages: list[Any], params: list[str] | None = None
    ) -> list[JsonObject]:
        """The messages as chat-template dicts, tool calls and results included; ``params`` names
        each message in errors (default ``messages[i]``).

        Raises APIError (400): an unknown role, a ``tool`` message whose ``tool_call_id`` answers
        no earlier call, arguments that are not JSON."""
        out: list[JsonObject] = []
        call_names: dict[str, str] = {}
        for i, m in enumerate(messages):
            param = params[i] if params else f"messages[{i}]"
            if m.role == "tool":
                out.append(_tool_result(m, call_names, self.native, param))
                continue
            if m.role not in ROLES:
                raise bad_request(
                    f"role {m.role!r} is not supported; use one of {sorted([*ROLES, 'tool'])}",
                    f"{param}.role",
                )
            text = message_text(m.content, f"{param}.content")
            message: JsonObject = {"role": ROLES[m.role], "content": text}
            if m.tool_calls:
                if m.role != "assistant":
                    raise bad_request(
                        "only assistant messages carry tool_calls", f"{param}.tool_calls"
                    )
                calls = []
                for j, call in enumerate(m.tool_calls):
                    try:
                        arguments = json.loads(call.function.arguments)
                    except ValueError:
                        raise bad_request(
                            "tool call arguments must be JSON text",
                            f"{param}.tool_calls[{j}].function.arguments",
                        ) from None
                    call_names[call.id] = call.function.name
                    calls.append({"name": call.function.name, "arguments": arguments})
                if self.native:
                    message["tool_calls"] = [
                        {"id": call.id, "type": "function", "function": c}
                        for call, c in zip(m.tool_calls, calls, strict=True)
                    ]
                else:
                    envelope = (
                        {"tool_calls": calls}
                        if len(calls) > 1 or self.parallel
                        else {"tool_call": calls[0]}
                    )
                    message["content"] = (text + "\n" if text else "") + json.dumps(envelope)
            out.append(message)
        if self.tools is not None and not self.native:
            call_format = self.parser.call_format if self.parser is not None else None
            prompt = generic_system_prompt(self.tools, self.parallel, call_format)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def constrain(self, params: SamplingParams, constraint_field: str) -> SamplingParams:
        """The params with the grammar tool_choice imposes (a 400 if another field set one), and
        special tokens kept where the call marker is one."""
        changes: dict = {}
        if self.constraint is not None:
            if params.structured_output is not None:
                raise bad_request(
                    f"{constraint_field} and tool_choice both constrain the output: set one",
                    constraint_field,
                )
            changes["structured_output"] = self.constraint
        if self.parser is not None and not self.parser.skip_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def constraint_param(self, constraint_field: str) -> str:
        """The field a grammar that does not compile is blamed on."""
        return "tools" if self.constraint is not None else constraint_field

    def reply(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply's content and tool calls (``reply_message``); a plan with a parser."""
        assert self.parser is not None
        return reply_message(self.parser, text)

    def stream(self) -> ToolCallStream:
        """One choice's stream of content and call deltas; a plan with a parser."""
        assert self.parser is not None
        return ToolCallStream(self.parser)

    @staticmethod
    def finish_reason(reason: str | None, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and reason == "stop" else reason


def plan_tools(
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    template: str,
    parser_name: str | None,
) -> ToolPlan:
    """The plan for a request; raises APIError (400) naming the bad field."""
    native = "tools" in template
    parallel = parallel_tool_calls is not False
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan(None, native, None, None, parallel)
    params: dict[str, JsonObject] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(
                f"tool type {tool.type!r} is not supported; use 'function'", f"tools[{i}].type"
            )
        name = tool.function.name
        if not name or name in params:
            raise bad_request(
                f"function names must be non-empty and unique, got {name!r}",
                f"tools[{i}].function.name",
            )
        param = f"tools[{i}].function.parameters"
        try:
            params[name] = checked_parameters(tool.function.parameters)
        except ToolSchemaError as exc:
            raise bad_request(f"invalid {param} (function {name!r}): {exc}", param) from None
    grammar = ToolGrammar(params)
    rendered = [msgspec.to_builtins(t) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if choice.type != "function" or name not in params:
            raise bad_request(f"tool_choice names an unknown function {name!r}", "tool_choice")
        constraint = _constraint(lambda: grammar.named(name))
        return ToolPlan(rendered, native, NamedParser(name), constraint, parallel)
    if choice == "none":
        return ToolPlan(None, native, None, None, parallel)
    if choice == "required":
        constraint = _constraint(lambda: grammar.required(parallel))
        return ToolPlan(rendered, native, RequiredParser(), constraint, parallel)
    if choice != "auto":
        raise bad_request(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            "tool_choice",
        )
    if parser_name is not None:
        parser = PARSERS[parser_name]()
    else:
        parser = parser_for_template(template)
    if not isinstance(parser, GenericParser):
        parser = parser if parallel else FirstCallOnly(parser)
        return ToolPlan(rendered, native, parser, None, parallel)
    constraint = _constraint(lambda: grammar.envelope(parallel))
    return ToolPlan(rendered, native, parser, constraint, parallel)


def _constraint(build: Callable[[], StructuredOutput]) -> StructuredOutput:
    try:
        return build()
    except ToolSchemaError as exc:
        raise bad_request(f"invalid tools: {exc}", "tools") from None


def generic_system_prompt(
    tools: list[JsonObject], parallel: bool, call_format: str | None = None
) -> str:
    """What a model without tool support is told about the tools and the reply format (the
    envelope, or ``call_format``: the chosen parser's own)."""
    listing = "You can call these tools:\n" + "\n".join(
        json.dumps(t["function"], ensure_ascii=False) for t in tools
    )
    if call_format is not None:
        return f"{listing}\n{call_format}"
    call = (
        '{"tool_calls": [{"name": ..., "arguments": {...}}]}'
        if parallel
        else ('{"tool_call": {"name": ..., "arguments": {...}}}')
    )
    return f'{listing}\nReply with JSON: {call} to call tools, or {{"response": "..."}} to answer.'


def _tool_result(m: Any, call_names: dict[str, str], native: bool, param: str) -> JsonObject:
    if m.tool_call_id is None:
        raise bad_request("a tool message needs tool_call_id", f"{param}.tool_call_id")
    if m.tool_call_id not in call_names:
        raise bad_request(
            f"tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant message",
            f"{param}.tool_call_id",
        )
    text = message_text(m.content, f"{param}.content")
    name = call_names[m.tool_call_id]
    if native:
        return {"role": "tool", "tool_call_id": m.tool_call_id, "name": name, "content": text}
    result = {"tool_call_id": m.tool_call_id, "name": name, "content": text}
    return {"role": "tool", "content": json.dumps({"tool_response": result})}


def reply_message(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when empty and there are calls) and tool calls."""
    parsed = parser.parse(text, final=True)
    calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
    ]
    return (parsed.content or None) if calls else parsed.content, calls
