"""The sampling fields completions and chat share, and how request fields become the engine's
``SamplingParams``: OpenAI's defaults, the vocabulary checks and the context check.

With n > 1 the engine runs sample ``i`` of a request with ``seed`` s at seed ``s + i``, so each
sample is reproducible on its own and equals a single request with that seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec

from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from paged_serve.server.errors import bad_request
from paged_serve.server.field_types import (
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
from paged_serve.server.structured import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputsField,
    from_guided_fields,
    from_response_format,
    from_structured_outputs,
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
    (``__post_init__`` fills it in for the fields read directly; ``to_params`` for the rest).
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
    # Structured outputs (server.structured): OpenAI's, vLLM's, and vLLM's older spelling.
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
    cache_salt: CacheSalt | None = None  # a prefix-cache partition (server.generation)

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

    def constraint(self) -> tuple[StructuredOutput, str] | None:
        """The output constraint and the field that set it; a 400 when two fields set one."""
        found: list[tuple[StructuredOutput, str]] = []
        if self.response_format is not None:
            constraint = from_response_format(self.response_format)
            if constraint is not None:
                found.append((constraint, "response_format"))
        if self.structured_outputs is not None:
            found.append((from_structured_outputs(self.structured_outputs), "structured_outputs"))
        guided = from_guided_fields(
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
        )
        if guided is not None:
            found.append(guided)
        if len(found) > 1:
            raise bad_request(
                f"{found[0][1]} and {found[1][1]} both constrain the output: set one",
                found[1][1],
            )
        return found[0] if found else None

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

    def to_params(
        self,
        vocab_size: int,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams, with OpenAI's defaults for the fields left out.

        ``max_tokens``, ``logprobs`` and ``prompt_logprobs`` (alternatives per prompt position
        the engine computes, None for none) are each endpoint's own. Raises APIError (400): for
        a token id outside the vocabulary, for a value SamplingParams refuses, and for a
        malformed output constraint (naming the field). ``compile_constraint`` then compiles
        the constraint before the request is queued."""
        constraint = self.constraint()
        logit_bias = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        _check_in_vocabulary([t for t, _ in logit_bias], vocab_size, "logit_bias")
        stop_token_ids = tuple(self.stop_token_ids or ())
        _check_in_vocabulary(stop_token_ids, vocab_size, "stop_token_ids")
        with sampling_errors_as_400():
            params = SamplingParams(
                max_tokens=max_tokens,
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                stop=self.stop_strings,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=logit_bias,
                stop_token_ids=stop_token_ids,
                skip_special_tokens=self.skip_special_tokens,
                structured_output=constraint[0] if constraint else None,
                prompt_logprobs=prompt_logprobs,
                min_tokens=self.min_tokens or 0,
            )
        return params


def _check_in_vocabulary(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise bad_request(
            f"{param} token {bad[0]} is outside the vocabulary [0, {vocab_size})", param
        )


@contextmanager
def sampling_errors_as_400() -> Iterator[None]:
    """A ValueError from SamplingParams becomes a 400 naming the field: its messages start
    with the field name ("top_p must be ...")."""
    try:
        yield
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field if field.isidentifier() else None) from None


def output_limit(
    context_limit: int,
    prompt_len: int,
    requested: int | None,
    prompt_param: str,
    default: int | None = None,
) -> int:
    """The max_tokens to run with, in tokens: the smallest of the requested one, the rest of the
    context and ``default`` (the generation config's ``max_new_tokens``), each where given, as
    vLLM takes it on every endpoint.

    Raises APIError (400, ``context_length_exceeded``) with the numbers when the prompt leaves no
    room or the requested limit does not fit beside it.
    """
    if requested is None:
        if prompt_len >= context_limit:
            raise bad_request(
                f"This model's maximum context length is {context_limit} tokens. However, your "
                f"prompt has {prompt_len} tokens, which leaves no room for a completion.",
                prompt_param,
                "context_length_exceeded",
            )
        limit = context_limit - prompt_len
    elif prompt_len + requested > context_limit:
        raise bad_request(
            f"This model's maximum context length is {context_limit} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or the completion length.",
            prompt_param,
            "context_length_exceeded",
        )
    else:
        limit = requested
    return limit if default is None else min(limit, default)


def check_sequences(limit: int, num_prompts: int, n: int) -> None:
    """400 if a request would start more than ``limit`` sequences (``num_prompts`` x ``n``),
    naming ``n`` if it alone is too many, else ``prompt``. Checked before any tokenizing."""
    if num_prompts * n <= limit:
        return
    param = "n" if n > limit else "prompt"
    raise bad_request(
        f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}); "
        f"this server allows at most {limit} per request",
        param,
    )
