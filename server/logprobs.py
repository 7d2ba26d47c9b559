"""Token logprobs in the two OpenAI shapes, and prompt logprobs in vLLM's.

Completions (legacy), ``CompletionLogprobs``::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

``top_logprobs`` holds the sampled token plus up to ``logprobs`` alternatives (so up to
logprobs + 1 entries, as OpenAI documents). ``text_offset`` is each token's character offset
in the choice's text. With ``echo`` the prompt's tokens come first, scored by the model like
generated ones; the first prompt token has no context, so its ``token_logprobs`` and
``top_logprobs`` entries are ``null`` (OpenAI's legacy shape, which evaluation harnesses read).

vLLM's ``prompt_logprobs``: one entry per prompt token, ``null`` for the first, else
``{token_id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and its top
alternatives; ``rank`` (1 = the likeliest) is known for the alternatives and for a prompt
token among them, ``null`` otherwise.

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
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @property
    def end_offset(self) -> int:
        """The character offset just past the last token (where the next chunk's offsets start);
        a non-empty object only."""
        return self.text_offset[-1] + len(self.tokens[-1])

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


def token_text(tokenizer: object | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: object | None, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    """The completions logprobs object of generated tokens; offsets start at ``text_offset``."""
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


def echo_logprobs(
    tokenizer: object | None,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprob | None],
    top: int,
) -> CompletionLogprobs:
    """The completions logprobs object of an echoed prompt (offsets from 0), with at most
    ``top`` alternatives per token; the first token's entries are ``None``."""
    first = token_text(tokenizer, prompt_ids[0])
    head = CompletionLogprobs(
        tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0]
    )
    scored = [TokenLogprob(lp.token_id, lp.logprob, lp.top[:top]) for lp in prompt_logprobs[1:]]
    return head.extend(completion_logprobs(tokenizer, scored, len(first)))


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``Logprob``: one token at one prompt position."""

    logprob: float
    rank: int | None  # 1 = the likeliest token there; None when not among the top returned
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def prompt_logprobs(
    tokenizer: object | None, entries: Sequence[TokenLogprob | None], top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), the token and its
    top ``top`` alternatives by id (JSON object keys are strings)."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        # the engine may return more alternatives than asked (the most any request of the
        # step asked for), best first: all of them tell ranks
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, 1)}
        alternatives = entry.top[:top]
        position = {
            entry.token_id: PromptLogprob(
                logprob=entry.logprob,
                rank=ranks.get(entry.token_id),
                decoded_token=token_text(tokenizer, entry.token_id),
            )
        }
        for token_id, value in alternatives:
            if token_id not in position:
                position[token_id] = PromptLogprob(
                    logprob=value,
                    rank=ranks[token_id],
                    decoded_token=token_text(tokenizer, token_id),
                )
        out.append(position)
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
