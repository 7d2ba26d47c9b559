"""Token logprobs in the two OpenAI shapes.

Completions (legacy), ``CompletionLogprobs``::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

``top_logprobs`` holds the sampled token plus up to ``logprobs`` alternatives (so up to
logprobs + 1 entries, as OpenAI documents). ``text_offset`` is each token's character offset
in the choice's text.

Chat, ``ChatLogprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}`` with exactly the requested number of alternatives.

A token's text is the tokenizer's decoding of that token alone, so a token that is part of a
multi-byte character shows as U+FFFD; models without a tokenizer show ``token_id:<id>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine.outputs import TokenLogprob


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @property
    def end_offset(self) -> int:
        """The character offset just past the last token (where the next chunk's offsets start)."""
        return self.text_offset[-1] + len(self.tokens[-1])


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob, kw_only=True):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: None = None


def token_text(tokenizer: object | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: object | None, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    """The completions logprobs object; offsets start at ``text_offset``."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top = {text: lp.logprob}
        for token_id, value in lp.top:
            top.setdefault(token_text(tokenizer, token_id), value)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def _chat_top(tokenizer: object | None, token_id: int, logprob: float) -> ChatTopLogprob:
    text = token_text(tokenizer, token_id)
    return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def chat_logprobs(tokenizer: object | None, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """The chat ``logprobs`` object."""
    content = []
    for lp in logprobs:
        sampled = _chat_top(tokenizer, lp.token_id, lp.logprob)
        content.append(
            ChatTokenLogprob(
                token=sampled.token,
                logprob=sampled.logprob,
                bytes=sampled.bytes,
                top_logprobs=[_chat_top(tokenizer, t, v) for t, v in lp.top],
            )
        )
    return ChatLogprobs(content=content)
