"""``POST /v1/responses`` on the wire: the request with its input items and flat function
tools, the Response object with its output items, and the stream's events.

Output items are ``message`` items and ``function_call`` items; ``tools``, ``tool_choice`` and
``parallel_tool_calls`` echo the request. Annotations on the text are always empty; ``logprobs``
are the chat shape's token entries (``paged_serve.server.protocol.logprobs.ChatTokenLogprob``)
when the request includes ``message.output_text.logprobs``, else empty; both are still sent, as
the reference lists them. ``text.format`` echoes the request's
(``paged_serve.server.protocol.structured``).

Events share ``{"type", "sequence_number"}``; the stream numbers them from 0 as it sends them
(``ResponseStream`` in ``paged_serve.server.responses.stream``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from paged_serve.server.protocol.common import ContentPart
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import (
    CacheSalt,
    ChatTopLogprobCount,
    Metadata,
    NonNegativeInt,
    PositiveInt,
    Temperature,
    TopP,
    User,
)
from paged_serve.server.protocol.logprobs import ChatTokenLogprob
from paged_serve.server.protocol.structured import ResponseText, TextFormat

OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served


class InputItem(msgspec.Struct, kw_only=True):
    """A Responses API input item: a ``message`` (role; content a string or text parts), a
    ``function_call`` (call_id, name, arguments) or a ``function_call_output`` (call_id,
    output); ``paged_serve.server.responses.tools`` checks which fields each needs."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Any] | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    """A flat function tool: ``{"type": "function", "name", "description", "parameters"}``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(msgspec.Struct, kw_only=True):
    """A named ``tool_choice``: ``{"type": "function", "name"}``."""

    type: str
    name: str | None = None


class ResponsesText(ResponseText, kw_only=True):
    """The Responses ``text`` field: ``format`` (``paged_serve.server.protocol.structured``) and
    ``verbosity``, which this server does not steer (only OpenAI's default, ``medium``, is
    accepted)."""

    verbosity: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: OpenAI pads its deltas with random ``obfuscation`` text to hide
    their sizes; this server never does, whatever ``include_obfuscation`` says."""

    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``. A ``null`` temperature or top_p takes the model's generation
    config default, else OpenAI's 1.0 (``SamplingDefaults.fill_responses``), which the Response
    object then reports.

    Fields of OpenAI's reference that this server does not implement are refused when set to
    anything but their default (``unsupported.RESPONSES_REFUSED``): a request that asks for a
    conversation object, a prompt template, reasoning, truncation, moderation or compaction must not
    silently get something else. Hints that change nothing in the output by the reference's own
    account (``user``, ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``,
    ``prompt_cache_options``, ``service_tier``, ``stream_options``) are accepted and ignored;
    ``max_tool_calls`` bounds built-in tool calls, of which this server makes none, so it always
    holds. Names the reference does not list are ignored, as OpenAI does.
    """

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False  # server.responses.background
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    user: User | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: NonNegativeInt | None = None
    text: ResponsesText | None = None
    include: list[str] | None = None
    top_logprobs: ChatTopLogprobCount | None = None
    cache_salt: CacheSalt | None = None  # vLLM's prefix-cache partition (server.generation.run)
    # accepted and ignored: caching, abuse-detection and billing hints
    safety_identifier: User | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    stream_options: ResponsesStreamOptions | None = None

    def __post_init__(self) -> None:
        self.store = self.store is not False
        self.stream = bool(self.stream)
        self.background = bool(self.background)

    def check(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", "input")
        self._check_unsupported()
        for value in self.include or ():
            if value != OUTPUT_TEXT_LOGPROBS:
                raise bad_request(
                    f"include value {value!r} is not supported by this server; the only one "
                    f"is {OUTPUT_TEXT_LOGPROBS!r}",
                    "include",
                )
        if self.top_logprobs and self.output_logprobs is None:
            raise bad_request(
                f"top_logprobs needs include to contain {OUTPUT_TEXT_LOGPROBS!r}", "top_logprobs"
            )
        if self.background and not self.store:
            raise bad_request(
                "background responses must be stored: set store to true (or leave it out)",
                "background",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def _check_unsupported(self) -> None:
        """``text.verbosity`` (the table-driven refusals are ``unsupported``)."""
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise bad_request(
                "text.verbosity is not supported by this server: only the default, 'medium'",
                "text.verbosity",
            )

    @property
    def output_logprobs(self) -> int | None:
        """Alternatives per output token the engine reports (None: no logprobs asked)."""
        if OUTPUT_TEXT_LOGPROBS not in (self.include or ()):
            return None
        return self.top_logprobs or 0


class FunctionCallItem(msgspec.Struct, kw_only=True):
    """A ``function_call`` output item (and the input item that replays one)."""

    id: str
    type: str = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens"


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a (background) response ``failed``."""

    code: str  # "server_error"
    message: str


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
