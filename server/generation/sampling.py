"""How request fields become the engine's ``SamplingParams``: OpenAI's defaults, the vocabulary
checks and the context check. The fields themselves are ``paged_serve.server.protocol``'s
(``SamplingFields``, which completions and chat share, and ``ResponsesRequest``).

With n > 1 the engine runs sample ``i`` of a request with ``seed`` s at seed ``s + i``, so each
sample is reproducible on its own and equals a single request with that seed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.generation.defaults import NO_DEFAULTS, SamplingDefaults
from paged_serve.server.generation.structured import from_text_format, request_constraint
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.responses import ResponsesRequest
from paged_serve.server.protocol.sampling import SamplingFields


def sampling_params(
    body: SamplingFields,
    vocab_size: int,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's SamplingParams of a completions or chat request, with OpenAI's defaults for
    the fields left out.

    ``max_tokens``, ``logprobs`` and ``prompt_logprobs`` (alternatives per prompt position
    the engine computes, None for none) are each endpoint's own. Raises APIError (400): for
    a token id outside the vocabulary, for a value SamplingParams refuses, and for a
    malformed output constraint (naming the field). ``compile_constraint`` then compiles
    the constraint before the request is queued."""
    constraint = request_constraint(body)
    logit_bias = tuple((int(k), v) for k, v in (body.logit_bias or {}).items())
    _check_in_vocabulary([t for t, _ in logit_bias], vocab_size, "logit_bias")
    stop_token_ids = tuple(body.stop_token_ids or ())
    _check_in_vocabulary(stop_token_ids, vocab_size, "stop_token_ids")
    with sampling_errors_as_400():
        params = SamplingParams(
            max_tokens=max_tokens,
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if body.repetition_penalty is None else body.repetition_penalty
            ),
            logit_bias=logit_bias,
            stop_token_ids=stop_token_ids,
            skip_special_tokens=body.skip_special_tokens,
            structured_output=constraint[0] if constraint else None,
            prompt_logprobs=prompt_logprobs,
            min_tokens=body.min_tokens or 0,
        )
    return params


def responses_params(
    body: ResponsesRequest, *, max_tokens: int, defaults: SamplingDefaults = NO_DEFAULTS
) -> SamplingParams:
    """The engine's SamplingParams of a Responses request (top-k, min-p and repetition penalty
    from ``defaults``); a value it refuses is a 400 naming the field."""
    constraint = from_text_format(body.text) if body.text is not None else None
    with sampling_errors_as_400():
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=defaults.top_k or 0,
            min_p=defaults.min_p or 0.0,
            repetition_penalty=defaults.repetition_penalty or 1.0,
            logprobs=body.output_logprobs,
            structured_output=constraint,
        )


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
