"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters (a UTF-8 character can span tokens) and
BPE spacing, so each new token is decoded together with a few previous ones and only the text
beyond them is emitted, and nothing is emitted while the tail is an incomplete character
(U+FFFD). The concatenated deltas equal decoding all the output tokens at once.

A run of tokens that keeps the tail incomplete is re-decoded on every token, so its length is
capped: past ``MAX_PENDING_TOKENS`` such tokens the text is emitted as it decodes, replacement
characters included, and a new run starts. A real character needs at most 4 bytes, so only a
stream that never completes a character (byte tokens forced by ``logit_bias``, say) or, rarely,
a long run of tokens that each end inside a character reaches the cap; the cost per token is
therefore bounded instead of growing with the run.

Stop strings are searched in the decoded text; the text is cut before the match. While a
request runs, the last ``len(longest stop) - 1`` characters are held back, so a stop string that
arrives split across tokens never leaks to the client.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6
MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    """Accumulates a request's output text; ``take_delta()`` returns what is safe to emit."""

    def __init__(
        self,
        tokenizer: object | None,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        tail = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = list(tail)
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.text = ""
        self._emitted = 0
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append a token; return True if a stop string now ends the text."""
        if self.tokenizer is None:
            return False
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        grew = len(full) > len(prefix) and not full.endswith(REPLACEMENT)
        if grew or len(self._ids) - self._read_offset >= MAX_PENDING_TOKENS:
            if len(full) > len(prefix):
                self._append_text(full[len(prefix) :])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self.stopped_on is not None

    def flush(self) -> None:
        """At the end, emit whatever is pending, incomplete characters included."""
        if self.tokenizer is None or self.stopped_on is not None:
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix):
            self._append_text(full[len(prefix) :])
        self._prefix_offset = self._read_offset = len(self._ids)

    def _append_text(self, delta: str) -> None:
        if self.stopped_on is not None:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        if not self.stop:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_on = best[1]

    def take_delta(self, finished: bool) -> str:
        """The text not yet emitted, minus the held-back tail unless ``finished``."""
        end = len(self.text) if finished or self.stopped_on else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
