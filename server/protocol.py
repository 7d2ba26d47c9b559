"""Request bodies as msgspec Structs: decoding them is the first layer of validation.

Field names follow the OpenAI API reference (plus vLLM's ``top_k``, ``min_p`` and
``ignore_eos``). Unknown fields are ignored, as OpenAI does. Range constraints are the
annotated types of ``paged_serve.server.field_types``, so a bad value is reported with the exact
field name; cross-field rules (``stop`` count, prompt shape) are checked by ``check()`` methods.
The sampling fields completions and chat share are ``paged_serve.server.sampling.SamplingFields``;
the documented fields this server refuses are ``paged_serve.server.unsupported_fields``'s table.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.errors import bad_request, from_decode_error
from paged_serve.server.field_types import (
    CacheSalt,
    ChatTopLogprobCount,
    CompletionLogprobCount,
    Metadata,
    NonNegativeInt,
    PositiveInt,
    Temperature,
    TopP,
    User,
)
from paged_serve.server.generation_defaults import NO_DEFAULTS, SamplingDefaults
from paged_serve.server.prompts import check_template_flags
from paged_serve.server.response_tools import ResponsesTool, ResponsesToolChoice
from paged_serve.server.sampling import SamplingFields, sampling_errors_as_400
from paged_serve.server.state import STATE
from paged_serve.server.structured import ResponseText, from_text_format
from paged_serve.server.tools import MessageToolCall, ToolChoice, ToolSpec

T = TypeVar("T")


def decode(body: bytes, type: type[T]) -> T:
    """Decode a JSON body into ``type``; raises APIError (400) naming the bad field."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise from_decode_error(exc) from None
    except msgspec.DecodeError as exc:
        param = _non_finite_param(body)
        if param is not None:
            raise bad_request(
                f"invalid value for {param}: NaN and Infinity are not valid JSON numbers", param
            ) from None
        raise from_decode_error(exc) from None
    except RecursionError:  # msgspec gives up on ~1000 levels of nesting (a 2 KB body)
        raise bad_request("the request body is nested too deeply") from None


def _non_finite_param(body: bytes) -> str | None:
    """Where a body that is JSON but for a ``NaN``/``Infinity`` literal has one, as a path
    like ``messages[0].content``; None for any other malformed body."""
    if b"NaN" not in body and b"Infinity" not in body:
        return None
    marker = object()
    try:
        data = json.loads(body, parse_constant=lambda _: marker)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, object]] = [("", data)]
    while stack:  # depth-first, first field first, without recursion
        path, value = stack.pop()
        if value is marker:
            return path.lstrip(".") or None
        if isinstance(value, dict):
            stack += [(f"{path}.{k}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or token-id lists."""

    prompt: str | list[str | int | list[int]]
    max_tokens: NonNegativeInt | None = 16  # 0 only scores the prompt (echo, prompt_logprobs)
    echo: bool | None = False
    logprobs: CompletionLogprobCount | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.max_tokens = 16 if self.max_tokens is None else self.max_tokens
        self.echo = bool(self.echo)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; raises APIError (400) for an empty or mixed list."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        items = self.prompt
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(p, str) for p in items):
            return list(items)
        if all(isinstance(p, int) for p in items):
            return [list(items)]
        if all(isinstance(p, list) for p in items):
            if any(not p for p in items):
                raise bad_request("a token-id prompt must not be empty", "prompt")
            return list(items)
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists",
            "prompt",
        )

    def check(self) -> None:
        self.check_sampling()
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise bad_request(
                "max_tokens 0 generates nothing: it only scores the prompt, with echo or "
                "prompt_logprobs",
                "max_tokens",
            )

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position the engine must compute: for ``prompt_logprobs``
        and for ``echo`` with ``logprobs`` (the prompt's tokens then carry logprobs, as in
        OpenAI's legacy API); an echo that generates nothing still runs the prompt (0)."""
        asked = [k for k in (self.prompt_logprobs, self.echo_logprobs) if k is not None]
        if asked:
            return max(asked)
        return 0 if self.echo and self.max_tokens == 0 else None

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token: ``logprobs`` when echoing, else None."""
        return self.logprobs if self.echo else None


class ContentPart(msgspec.Struct, kw_only=True):
    """A message content part; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """``tool_calls`` on assistant messages; ``tool_call_id`` on ``tool`` messages."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. vLLM's template flags: ``add_generation_prompt`` (open
    a new assistant turn) and ``continue_final_message`` (leave the last message open, to be
    continued); ``echo`` puts the last message's text in front of the reply when the reply
    continues that message's role."""

    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: ChatTopLogprobCount | None = None
    tools: list[ToolSpec] | None = None  # server.tools
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)
        self.echo = bool(self.echo)
        self.add_generation_prompt = self.add_generation_prompt is not False
        self.continue_final_message = bool(self.continue_final_message)

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        self.check_sampling()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        check_template_flags(self.add_generation_prompt, self.continue_final_message)

    @property
    def reply_role(self) -> str:
        """The reply's role, as vLLM has it: a new assistant turn with the generation prompt,
        else a continuation of the last message, in its role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


class InputItem(msgspec.Struct, kw_only=True):
    """A Responses API input item: a ``message`` (role; content a string or text parts), a
    ``function_call`` (call_id, name, arguments) or a ``function_call_output`` (call_id,
    output); ``paged_serve.server.response_tools`` checks which fields each needs."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Any] | None = None


OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served


class ResponsesText(ResponseText, kw_only=True):
    """The Responses ``text`` field: ``format`` (``paged_serve.server.structured``) and
    ``verbosity``, which this server does not steer (only OpenAI's default, ``medium``, is
    accepted)."""

    verbosity: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: OpenAI pads its deltas with random ``obfuscation`` text to hide
    their sizes; this server never does, whatever ``include_obfuscation`` says."""

    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``. A ``null`` temperature or top_p takes the model's generation
    config default, else OpenAI's 1.0 (``with_defaults``), which the Response object then
    reports.

    Fields of OpenAI's reference that this server does not implement are refused when set to
    anything but their default (``unsupported_fields.RESPONSES_REFUSED``): a request that asks for a
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
    background: bool | None = False  # server.background
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
    cache_salt: CacheSalt | None = None  # vLLM's prefix-cache partition (server.generation)
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
        """``text.verbosity`` (the table-driven refusals are ``unsupported_fields``)."""
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

    def with_defaults(self, defaults: SamplingDefaults) -> ResponsesRequest:
        """This request with ``defaults`` (the model's generation config) where it leaves
        temperature or top_p out, then OpenAI's 1.0 for what is still out; top-k, min-p and
        the repetition penalty come from ``defaults`` alone (the Responses API has no such
        fields)."""
        body = defaults.fill(self)
        body.temperature = 1.0 if body.temperature is None else body.temperature
        body.top_p = 1.0 if body.top_p is None else body.top_p
        return body

    def to_params(
        self, *, max_tokens: int, defaults: SamplingDefaults = NO_DEFAULTS
    ) -> SamplingParams:
        """The engine's SamplingParams (top-k, min-p and repetition penalty from
        ``defaults``); a value it refuses is a 400 naming the field."""
        constraint = from_text_format(self.text) if self.text is not None else None
        with sampling_errors_as_400():
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=defaults.top_k or 0,
                min_p=defaults.min_p or 0.0,
                repetition_penalty=defaults.repetition_penalty or 1.0,
                logprobs=self.output_logprobs,
                structured_output=constraint,
            )


RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest, ResponsesRequest)


async def read_request(request: web.Request, type: type[RequestT]) -> RequestT:
    """The body of ``request`` as ``type``, checked, naming a served model (or none), with the
    server's sampling defaults where it leaves a field out (``generation_defaults``).

    Raises APIError: 400 naming the bad field, 404 for another model.
    """
    body = decode(await request.read(), type)
    body.check()
    state = request.app[STATE]
    state.check_model(body.model)
    _check_logprob_counts(body, state.limits.max_logprobs)
    if isinstance(body, ResponsesRequest):
        return body.with_defaults(state.sampling_defaults)
    return state.sampling_defaults.fill(body)


def _check_logprob_counts(body: msgspec.Struct, limit: int) -> None:
    """400 naming the field when a request asks for more alternatives than ``--max-logprobs``
    (chat's boolean ``logprobs`` is not a count)."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(body, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise bad_request(
                f"{name} must be at most {limit} on this server (--max-logprobs), got {value}",
                name,
            )
