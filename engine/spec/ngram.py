"""Prompt lookup: draft the tokens that followed the last time the sequence's suffix occurred.

For a sequence ``x[0:L]`` (prompt then output) and ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, find the latest ``e < L`` with ``x[e-n:e] == x[L-n:L]`` and propose
``x[e:e+k]``: where the output copies the prompt (edits, summaries with quotes, code
refactors, answers from retrieved text) the guess runs ahead of the model by whole phrases.

Each sequence keeps an index per ``n`` from n-gram to its latest end, extended by the tokens
appended since the last proposal, so a step costs O(new tokens), not O(L).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_serve.engine.sched.request import Request


@dataclass(slots=True)
class _SequenceIndex:
    """One sequence's tokens so far and, per n, n-gram -> end of its latest occurrence that
    is not the current suffix (ends ``n .. len(tokens) - 1``)."""

    sizes: range
    tokens: list[int] = field(default_factory=list)
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed_to: int = 0  # n-grams ending before this position are in ``ends``

    def extend(self, request: Request) -> None:
        """Take the tokens the request gained (its token lists only ever grow)."""
        have, prompt = len(self.tokens), request.prompt_token_ids
        if have < len(prompt):
            self.tokens += prompt[have:]
            have = len(prompt)
        self.tokens += request.output_token_ids[have - len(prompt) :]
        tokens = self.tokens
        for end in range(max(self.indexed_to, 1), len(tokens)):  # every end but len(tokens)
            for n in self.sizes:
                if end >= n:
                    self.ends.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        self.indexed_to = max(len(tokens), 1)

    def lookup(self, k: int) -> list[int]:
        """The ``k`` tokens after the latest earlier occurrence of the longest matching suffix."""
        tokens = self.tokens
        for n in reversed(self.sizes):
            if len(tokens) <= n:
                continue
            end = self.ends.get(n, {}).get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramDrafter:
    """Model-free drafts from each sequence's own tokens (``engine/spec/drafter.py``)."""

    def __init__(self, *, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self._index: dict[str, _SequenceIndex] = {}

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, limits):
            index = self._index.get(request.request_id)
            if index is None:
                index = self._index[request.request_id] = _SequenceIndex(self.sizes)
            index.extend(request)
            drafts.append(index.lookup(k))
        return drafts

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
