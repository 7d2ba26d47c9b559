"""The Responses API's objects: the Response, its output message, and the stream's events.

Output items are ``message`` items and ``function_call`` items
(``paged_serve.server.response_tools``); ``tools``, ``tool_choice`` and ``parallel_tool_calls`` echo
the request. Annotations on the text are always empty; ``logprobs`` are the chat shape's token
entries (``paged_serve.server.logprobs.ChatTokenLogprob``) when the request includes
``message.output_text.logprobs``, else empty; both are still sent, as the reference lists them.
``text.format`` echoes the request's (``paged_serve.server.structured``).

Events share ``{"type", "sequence_number"}``; the stream numbers them from 0 as it sends them
(``ResponseStream`` in ``paged_serve.server.response_stream``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from paged_serve.server.logprobs import ChatTokenLogprob
from paged_serve.server.response_tools import FunctionCallItem


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens"


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a (background) response ``failed``."""

    code: str  # "server_error"
    message: str


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields beside."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int


class OutputText(msgspec.Struct, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatTokenLogprob] = []


class OutputMessage(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    status: str  # "in_progress", "completed" or "incomplete"
    content: list[OutputText]


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int  # Unix seconds
    completed_at: int | None
    # "queued", "in_progress", "completed", "incomplete", "failed" or "cancelled"
    status: str
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    background: bool = False
    store: bool
    temperature: float
    top_p: float
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = []
    max_tool_calls: int | None = None
    top_logprobs: int = 0
    truncation: str = "disabled"
    metadata: dict[str, str]
    user: str | None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None


class ResponseDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True


class StreamEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int = 0  # set by the stream as it sends the event


class ResponseEvent(StreamEvent, kw_only=True):
    """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``."""

    response: Response


class OutputItemEvent(StreamEvent, kw_only=True):
    """``response.output_item.added`` and ``.done``."""

    output_index: int = 0
    item: OutputMessage | FunctionCallItem


class ContentEvent(StreamEvent, kw_only=True):
    """An event about one content part of one output item."""

    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(ContentEvent, kw_only=True):
    """``response.content_part.added`` and ``.done``."""

    part: OutputText


class TextDeltaEvent(ContentEvent, kw_only=True):
    """``response.output_text.delta``."""

    delta: str
    logprobs: list[ChatTokenLogprob] = []  # the delta's tokens


class TextDoneEvent(ContentEvent, kw_only=True):
    """``response.output_text.done``."""

    text: str
    logprobs: list[ChatTokenLogprob] = []  # the whole part's tokens


class FunctionCallArgumentsDelta(StreamEvent, kw_only=True):
    """``response.function_call_arguments.delta``: a fragment of a call's arguments."""

    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(StreamEvent, kw_only=True):
    """``response.function_call_arguments.done``: the call's whole arguments."""

    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent, kw_only=True):
    """``error``: a failure once the stream has started (its status can no longer change)."""

    type: str = "error"
    code: str | None
    message: str
    param: str | None
