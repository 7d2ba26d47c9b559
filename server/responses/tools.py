"""Function tools in the Responses API, mapped onto the chat tools of
``paged_serve.server.tools.planning``.

Requests: ``tools`` are flat (``{"type": "function", "name", "description", "parameters"}``),
a named ``tool_choice`` is ``{"type": "function", "name"}``, and ``input`` items may be
``function_call`` items (a call the model made) and ``function_call_output`` items (its result,
by ``call_id``), besides messages. The conversation a stored response carries over to a
``previous_response_id`` follow-up is kept as chat messages
(``paged_serve.server.protocol.chat.ChatMessage``), so tool calls and results survive it.

Replies: text before the calls is an output ``message``; each call is a ``function_call``
output item (``id`` ``fc_…``, ``call_id`` ``call_…``).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.responses import (
    FunctionCallItem,
    ResponsesTool,
    ResponsesToolChoice,
)
from paged_serve.server.protocol.tools import (
    FunctionSpec,
    MessageFunctionCall,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolSpec,
)


def new_item_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


def chat_tools(tools: list[ResponsesTool] | None) -> list[ToolSpec] | None:
    """The tools as chat tools; 400 for a tool that is not a named function."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(
                f"tool type {tool.type!r} is not supported; use 'function'", f"tools[{i}].type"
            )
        if not tool.name:
            raise bad_request("a function tool needs a name", f"tools[{i}].name")
        function = FunctionSpec(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(ToolSpec(type="function", function=function))
    return out


def chat_tool_choice(choice: str | ResponsesToolChoice | None) -> ToolChoice | None:
    if isinstance(choice, ResponsesToolChoice):
        if choice.type != "function" or not choice.name:
            raise bad_request("a named tool_choice is {type: function, name}", "tool_choice")
        return NamedToolChoice(type="function", function=NamedFunction(choice.name))
    return choice


def input_messages(items: list[Any]) -> tuple[list[dict], list[str]]:
    """Input items as chat messages (``ChatMessage`` builtins), with the field that names each;
    consecutive ``function_call`` items make one assistant message."""
    messages: list[dict] = []
    params: list[str] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise bad_request("a message item needs a role", f"{param}.role")
            content = item.content
            if content is None:
                raise bad_request("a message item needs content", f"{param}.content")
            messages.append({"role": item.role, "content": msgspec.to_builtins(content)})
        elif item.type == "function_call":
            if not (item.call_id and item.name and item.arguments is not None):
                raise bad_request("a function_call item needs call_id, name, arguments", param)
            call = MessageToolCall(
                id=item.call_id,
                function=MessageFunctionCall(name=item.name, arguments=item.arguments),
            )
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(msgspec.to_builtins(call))
                continue
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [msgspec.to_builtins(call)]}
            )
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise bad_request("a function_call_output item needs call_id, output", param)
            output = (
                item.output
                if isinstance(item.output, str)
                else msgspec.json.encode(item.output).decode()
            )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise bad_request(f"input item type {item.type!r} is not supported", f"{param}.type")
        params.append(param)
    return messages, params


def assistant_message(content: str | None, calls: list[FunctionCallItem]) -> dict:
    """The reply as a chat message, for the conversation a follow-up continues."""
    message: dict = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message
