"""The one interface every drafter has: propose up to ``k`` next tokens for a sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged_serve.engine.sched.request import Request


class Drafter(Protocol):
    """Guesses the next tokens of running sequences (prompt lookup, a draft model, a test's).

    ``propose`` gets the sequences that may speculate this step and each one's most tokens
    (``limits[i] >= 1``); it returns one list per sequence, at most that long (empty: no
    guess). A guess is only a guess: the target model's own draw decides every token
    (``engine/sample/sampling_rows.py``), so a wrong one costs time, never output.
    ``release`` forgets a sequence that ended (its index, its draft KV blocks).
    """

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]: ...

    def release(self, request_id: str) -> None: ...
