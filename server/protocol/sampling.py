"""The sampling fields completions and chat share, with the rules between them that msgspec
cannot express (``check_sampling``).

How they become the engine's ``SamplingParams`` (OpenAI's defaults, the vocabulary checks, the
output constraint) is ``paged_serve.server.generation.sampling``.
"""

from __future__ import annotations

import msgspec

from paged_serve.engine.sampling_params import MAX_LOGIT_BIAS
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import (
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_DIGITS,
    CacheSalt,
    MinP,
    NonNegativeInt,
    NumChoices,
    Penalty,
    PositiveInt,
    PromptLogprobCount,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenId,
    TopK,
    TopP,
    User,
)
from paged_serve.server.protocol.structured import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputsField,
)

_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class StreamOptions(msgspec.Struct, kw_only=True):
    """``include_usage``: a last chunk carries the usage. vLLM's ``continuous_usage_stats``:
    every chunk also carries the usage so far (``include_usage`` left out then counts as true,
    as in vLLM, where it defaults to true)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The sampling fields completions and chat share.

    Fields OpenAI documents as nullable accept ``null`` and take their default
    (``__post_init__`` fills it in for the fields read directly;
    ``paged_serve.server.generation.sampling.sampling_params`` for the rest).
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
    # Structured outputs (protocol.structured): OpenAI's, vLLM's, and vLLM's older spelling.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: PromptLogprobCount | None = None
    min_tokens: NonNegativeInt | None = None
    best_of: PositiveInt | None = None  # only n itself: no sample is ranked or dropped
    include_stop_str_in_output: bool | None = False
    return_token_ids: bool | None = False  # prompt and completion token ids in the reply
    return_tokens_as_token_ids: bool | None = False  # logprob tokens as "token_id:<id>"
    cache_salt: CacheSalt | None = None  # a prefix-cache partition (server.generation.run)

    def __post_init__(self) -> None:
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)
        self.skip_special_tokens = self.skip_special_tokens is not False
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)
        self.return_token_ids = bool(self.return_token_ids)
        self.return_tokens_as_token_ids = bool(self.return_tokens_as_token_ids)

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        options = self.stream_options
        return self.stream and options is not None and bool(options.continuous_usage_stats)

    @property
    def include_usage(self) -> bool:
        """The stream ends with a usage chunk."""
        options = self.stream_options
        if not self.stream or options is None:
            return False
        if options.include_usage is None:
            return self.continuous_usage
        return options.include_usage

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
        if self.continuous_usage and self.stream_options.include_usage is False:
            raise bad_request(
                "stream_options.continuous_usage_stats needs include_usage (true or left out)",
                "stream_options.continuous_usage_stats",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request(
                "prompt_logprobs are not available when stream is true (as in vLLM); "
                "completions can stream echo with logprobs instead",
                "prompt_logprobs",
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

    @property
    def constraint_field(self) -> str:
        """The field that constrains the output, to name in a compile error."""
        for name in _CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.type == "text"):
                return name
        return "response_format"
