"""Token logprobs on the wire: the two OpenAI shapes, and vLLM's prompt logprobs.

Completions (legacy), ``CompletionLogprobs``::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

Chat, ``ChatLogprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}``.

vLLM's ``prompt_logprobs``, ``PromptLogprobs``: one entry per prompt token, ``null`` for the
first, else ``{token_id: {"logprob", "rank", "decoded_token"}}``.

How they are filled in is ``paged_serve.server.generation.logprobs``.
"""

from __future__ import annotations

import msgspec


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def extend(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """``other``'s entries appended (its offsets already continue this one's)."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset
        return self


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8 bytes


class ChatTokenLogprob(ChatTopLogprob, kw_only=True):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: None = None


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``Logprob``: one token at one prompt position."""

    logprob: float
    rank: int | None  # 1 = the likeliest token there; None when not among the top returned
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]
