"""Function tools on the wire (chat completions): the request's ``tools`` and ``tool_choice``,
the tool calls of past assistant messages, and the calls of a reply, whole and as stream deltas.

What the server does with them is ``paged_serve.server.tools.planning``; the Responses API's flat
tool shapes are ``paged_serve.server.protocol.responses``'.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

JsonObject = dict[str, Any]


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionSpec


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    function: NamedFunction


ToolChoice = str | NamedToolChoice


class MessageFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call on an assistant message of the request's conversation."""

    id: str
    type: str = "function"
    function: MessageFunctionCall


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    """A call of a whole reply."""

    id: str
    type: str = "function"
    function: FunctionCall


class FunctionDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A streamed call: the first delta of a call has its id and name, later ones argument
    fragments (the concatenation is the arguments' JSON text)."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionDelta
