"""Request bodies as msgspec Structs: decoding them is the first layer of validation.

Field names follow the OpenAI API reference (plus vLLM's ``top_k``, ``min_p`` and
``ignore_eos``). Unknown fields are ignored, as OpenAI does. Range constraints live here, as
``msgspec.Meta``, so a bad value is reported with the exact field name; cross-field rules
(``stop`` count, prompt shape, unsupported options) are checked by ``check()`` methods.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from engine.sampling_params import MAX_LOGIT_BIAS, MAX_N
from server.errors import bad_request, from_decode_error

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# the engine carries top_k as an int32 per row; larger values disable top-k anyway
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
# sample i of n runs with seed + i, which must stay a signed 64-bit integer
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - MAX_N)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
MAX_STOP_TOKEN_IDS = 64
# a logit_bias key is a token id written in ASCII digits; 10 digits hold any int32 id, and a
# bound keeps int() away from Python's 4300-digit limit (a ValueError, once a 500)
MAX_TOKEN_ID_DIGITS = 10
# OpenAI's limits: 16 metadata pairs, keys up to 64 characters, values up to 512; user ids
# (like safety_identifier) up to 64 characters
MetadataKey = Annotated[str, msgspec.Meta(max_length=64)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=16)]
User = Annotated[str, msgspec.Meta(max_length=64)]

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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling fields completions and chat share.

    Fields OpenAI documents as nullable accept ``null`` and take their default
    (``__post_init__`` fills it in, so code past decoding never sees None there).
    """

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: NumChoices | None = 1
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: User | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = True
    ignore_eos: bool | None = False

    def __post_init__(self) -> None:
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)
        self.skip_special_tokens = self.skip_special_tokens is not False

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_sampling(self) -> None:
        """Rules msgspec cannot express; raises APIError (400)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        stops = self.stop_strings
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop sequences are allowed", "stop")
        if any(s == "" for s in stops):
            raise bad_request("stop sequences must be non-empty strings", "stop")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise bad_request(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", "stop_token_ids"
            )
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdecimal() and len(key) <= MAX_TOKEN_ID_DIGITS):
                shown = repr(key) if len(key) <= 32 else f"{key[:32]!r}... ({len(key)} characters)"
                raise bad_request(
                    f"logit_bias keys must be token ids in ASCII digits (at most "
                    f"{MAX_TOKEN_ID_DIGITS}), got {shown}",
                    "logit_bias",
                )
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise bad_request(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for token {key}",
                    "logit_bias",
                )

    def logit_bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a token outside the vocabulary is a 400."""
        pairs = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        _check_in_vocabulary([t for t, _ in pairs], vocab_size, "logit_bias")
        return pairs

    def stop_ids(self, vocab_size: int) -> tuple[int, ...]:
        """``stop_token_ids``; a token outside the vocabulary is a 400."""
        ids = tuple(self.stop_token_ids or ())
        _check_in_vocabulary(ids, vocab_size, "stop_token_ids")
        return ids


def _check_in_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise bad_request(
            f"{param} token {bad[0]} is outside the vocabulary [0, {vocab_size})", param
        )


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or token-id lists."""

    prompt: str | list[str | int | list[int]]
    max_tokens: PositiveInt | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None

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
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request(
                "echo with logprobs needs prompt logprobs, which this server does not compute",
                "logprobs",
            )


class ContentPart(msgspec.Struct, kw_only=True):
    """A message content part; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)

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
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(
                "only the text response_format is supported by this server", "response_format"
            )


class InputItem(msgspec.Struct, kw_only=True):
    """A Responses API input message (``type`` "message"; content a string or text parts)."""

    role: str
    content: str | list[ContentPart]
    type: str = "message"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``."""

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    store: bool | None = True
    stream: bool | None = False
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    user: User | None = None
    tools: list[Any] | None = None

    def __post_init__(self) -> None:
        self.store = self.store is not False
        self.stream = bool(self.stream)

    def check(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", "input")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
