"""Token logprobs in the two OpenAI shapes, and prompt logprobs in vLLM's (the Structs are
``paged_serve.server.protocol.logprobs``).

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
token among them, ``null`` otherwise. Such a list grows with prompt tokens x alternatives
(8,000 tokens at 20 alternatives: 12 MB of JSON from a 30 KB request), so a request is refused
beyond ``ServerLimits.max_prompt_logprob_entries`` (``check_prompt_logprobs_size``), and the
endpoints build and encode it in the tokenizer thread, off the event loop.

Chat, ``ChatLogprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}`` with exactly the requested number of alternatives.

A token's text is the tokenizer's decoding of that token alone, so a token that is part of a
multi-byte character shows as U+FFFD; models without a tokenizer show ``token_id:<id>``, and so
does every model with vLLM's ``return_tokens_as_token_ids`` (``as_ids``), in ``tokens``, the
``top_logprobs`` keys and the chat ``token`` fields. ``text_offset`` and chat ``bytes`` stay
those of the token's text, which is what they describe; vLLM's ``prompt_logprobs`` keep their
``decoded_token`` text (they are keyed by id already).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_serve.engine.outputs import TokenLogprob
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.logprobs import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)


def token_text(tokenizer: object | None, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def token_name(tokenizer: object | None, token_id: int, as_ids: bool) -> str:
    """How logprobs show a token: its text, or ``token_id:<id>`` with ``as_ids``."""
    return f"token_id:{token_id}" if as_ids else token_text(tokenizer, token_id)


class ChoiceLogprobs:
    """One choice's completions logprobs, built in pieces (the echoed prompt, then each
    stream chunk's tokens): each piece's ``text_offset`` continues where the last one ended."""

    def __init__(self, tokenizer: object | None, *, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.offset = 0  # characters of token text so far: the next token's text_offset

    def _name(self, token_id: int) -> str:
        return token_name(self.tokenizer, token_id, self.as_ids)

    def generated(self, logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """The logprobs object of these tokens (each with its alternatives, best first)."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in logprobs:
            text = token_text(self.tokenizer, lp.token_id)
            name = f"token_id:{lp.token_id}" if self.as_ids else text
            out.tokens.append(name)
            out.token_logprobs.append(lp.logprob)
            top = {name: lp.logprob}
            for token_id, value in lp.top:
                top.setdefault(self._name(token_id), value)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out

    def echo(
        self,
        prompt_ids: Sequence[int],
        prompt_logprobs: Sequence[TokenLogprob | None],
        top: int,
    ) -> CompletionLogprobs:
        """The logprobs object of an echoed prompt, with at most ``top`` alternatives per
        token; the first token has no context, so its entries are ``None``."""
        first = prompt_ids[0]
        text = token_text(self.tokenizer, first)
        head = CompletionLogprobs(
            tokens=[f"token_id:{first}" if self.as_ids else text],
            token_logprobs=[None],
            top_logprobs=[None],
            text_offset=[self.offset],
        )
        self.offset += len(text)
        scored = [TokenLogprob(lp.token_id, lp.logprob, lp.top[:top]) for lp in prompt_logprobs[1:]]
        return head.extend(self.generated(scored))


def check_prompt_logprobs_size(limit: int, prompt_tokens: int, top: int, lists: int = 1) -> None:
    """400 naming ``prompt_logprobs`` when ``lists`` lists of ``prompt_tokens`` positions with
    the prompt token and ``top`` alternatives each would hold more than ``limit`` entries."""
    entries = lists * prompt_tokens * (top + 1)
    if entries <= limit:
        return
    per_choice = f" in each of {lists} choices" if lists > 1 else ""
    raise bad_request(
        f"prompt_logprobs {top} over {prompt_tokens} prompt tokens{per_choice} is {entries:,} "
        f"entries (prompt tokens x (prompt_logprobs + 1)), more than this server's "
        f"{limit:,}: ask for fewer alternatives, fewer choices or a shorter prompt",
        "prompt_logprobs",
    )


def prompt_logprobs(
    tokenizer: object | None, entries: Sequence[TokenLogprob | None], top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), the token and its
    top ``top`` alternatives by id (JSON object keys are strings). Megabytes for a long
    prompt: call it off the event loop."""
    texts: dict[int, str] = {}  # the same alternatives recur at many positions: decode once

    def text(token_id: int) -> str:
        found = texts.get(token_id)
        if found is None:
            found = texts[token_id] = token_text(tokenizer, token_id)
        return found

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
                decoded_token=text(entry.token_id),
            )
        }
        for token_id, value in alternatives:
            if token_id not in position:
                position[token_id] = PromptLogprob(
                    logprob=value,
                    rank=ranks[token_id],
                    decoded_token=text(token_id),
                )
        out.append(position)
    return out


def _chat_top(
    tokenizer: object | None, token_id: int, logprob: float, as_ids: bool
) -> ChatTopLogprob:
    text = token_text(tokenizer, token_id)
    return ChatTopLogprob(
        token=token_name(tokenizer, token_id, as_ids), logprob=logprob, bytes=list(text.encode())
    )


def chat_logprobs(
    tokenizer: object | None, logprobs: Sequence[TokenLogprob], *, as_ids: bool = False
) -> ChatLogprobs:
    """The chat ``logprobs`` object; ``as_ids``: tokens shown as ``token_id:<id>``."""
    content = []
    for lp in logprobs:
        sampled = _chat_top(tokenizer, lp.token_id, lp.logprob, as_ids)
        content.append(
            ChatTokenLogprob(
                token=sampled.token,
                logprob=sampled.logprob,
                bytes=sampled.bytes,
                top_logprobs=[_chat_top(tokenizer, t, v, as_ids) for t, v in lp.top],
            )
        )
    return ChatLogprobs(content=content)
