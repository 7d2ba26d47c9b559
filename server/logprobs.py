"""Token logprobs in the two OpenAI shapes.

Completions (legacy)::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

``top_logprobs`` holds the sampled token plus up to ``logprobs`` alternatives (so up to
logprobs + 1 entries, as OpenAI documents). ``text_offset`` is each token's character offset
in the choice's text.

Chat (and Responses): ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]`` with exactly the requested number of alternatives.

A token's text is the tokenizer's decoding of that token alone, so a token that is part of a
multi-byte character shows as U+FFFD; models without a tokenizer show ``token_id:<id>``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import TokenLogprob


def token_text(tokenizer: object | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: object | None, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> dict:
    """The completions logprobs object; offsets start at ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top = {text: lp.logprob}
        for token_id, value in lp.top:
            top.setdefault(token_text(tokenizer, token_id), value)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _entry(tokenizer: object | None, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(tokenizer: object | None, logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """The chat ``logprobs.content`` list."""
    content = []
    for lp in logprobs:
        entry = _entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return content
