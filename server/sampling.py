"""From request fields to engine ``SamplingParams``: OpenAI's defaults and the context check.

With n > 1 the engine runs sample ``i`` of a request with ``seed`` s at seed ``s + i``, so each
sample is reproducible on its own and equals a single request with that seed.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from server.errors import bad_request
from server.protocol import SamplingFields


def output_limit(
    context_limit: int, prompt_len: int, requested: int | None, prompt_param: str
) -> int:
    """The max_tokens to run with: the requested one if it fits, else the rest of the context.

    Raises APIError (400, ``context_length_exceeded``) with the numbers when it does not fit.
    """
    if requested is None:
        if prompt_len >= context_limit:
            raise bad_request(
                f"This model's maximum context length is {context_limit} tokens. However, your "
                f"prompt has {prompt_len} tokens, which leaves no room for a completion.",
                prompt_param,
                "context_length_exceeded",
            )
        return context_limit - prompt_len
    if prompt_len + requested > context_limit:
        raise bad_request(
            f"This model's maximum context length is {context_limit} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or the completion length.",
            prompt_param,
            "context_length_exceeded",
        )
    return requested


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


def build_params(
    *,
    max_tokens: int,
    n: int = 1,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    skip_special_tokens: bool = True,
) -> SamplingParams:
    """SamplingParams with OpenAI's defaults (temperature 1, top_p 1); ValueError -> 400."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            n=n,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            logit_bias=logit_bias,
            stop_token_ids=stop_token_ids,
            skip_special_tokens=skip_special_tokens,
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field name ("top_p must be ...").
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field if field.isidentifier() else None) from None


def request_params(
    body: SamplingFields, vocab_size: int, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """SamplingParams from the fields completions and chat share (ids checked against the
    vocabulary); ``max_tokens`` and ``logprobs`` are each endpoint's own."""
    return build_params(
        max_tokens=max_tokens,
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_strings,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.logit_bias_pairs(vocab_size),
        stop_token_ids=body.stop_ids(vocab_size),
        skip_special_tokens=body.skip_special_tokens,
    )
