"""When and how far each sequence speculates, and what came of it.

A step's decoding sequences get drafts only while at most ``disable_by_batch_size`` sequences
run: past that the batch already fills the machine and verifying guesses costs more than it
saves. Each sequence then keeps its own pace:

* ``k``, the tokens it drafts, follows its recent accepted runs: doubled (up to
  ``num_speculative_tokens``) after a step that accepted every draft, otherwise one past the
  run the step accepted;
* ``rate``, an average of accepted / drafted over its recent steps (weight 1/2 per step):
  below ``MIN_ACCEPTANCE`` it stops drafting for ``skip`` steps, a pause that doubles (up to
  ``MAX_PAUSE_STEPS``) each time it falls below again, so text that does not repeat itself
  costs a verification now and then, not every step.

A draft also stops where the sequence must: its ``max_tokens``, the model's length, the step's
token budget, and its grammar (a drafted token the matcher refuses, or one that would end the
grammar, ends the draft there; the matcher is rolled back, it has accepted nothing), and its
matcher's speed: a drafted step fills one mask per row, one after another, so a sequence drafts
no more tokens than keeps its rows' fills, at their last measured cost, within one row's
``--grammar-fill-timeout`` (none once a fill takes half of it; none with an xgrammar whose
matchers cannot ``fork``, which filling drafted rows needs). Pacing
changes how many tokens a step yields, never which: the target's draw decides each
(``engine/sample/sampling_rows.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from paged_serve.engine.sample.token_mask import can_walk_drafts
from paged_serve.engine.sched.request import Request
from paged_serve.engine.spec.config import SpeculativeConfig
from paged_serve.engine.spec.drafter import Drafter

MIN_ACCEPTANCE = 0.25  # accepted / drafted below which a sequence pauses drafting
MAX_PAUSE_STEPS = 64
MAX_DRAFTS_UNTIMED = 1 << 30  # no mask fill measured yet: no limit from the grammar


@dataclass(slots=True)
class _Pace:
    """One sequence's drafting pace (see the module docstring)."""

    k: int
    rate: float = 0.5
    skip: int = 0
    pause: int = 1


@dataclass(slots=True)
class SpecStats:
    """Drafting counts since start, vLLM's: drafts (sequence-steps that drafted), drafted and
    accepted tokens, and accepted tokens by position in the draft (0 = first drafted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting sequence-step yields on average: its accepted drafts plus the
        target's own token (1 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Speculator:
    """Drafts for the scheduler (``drafts``) and learns from each verified step (``observe``).

    ``max_model_len``: the longest sequence in tokens (a draft never runs past it).
    """

    def __init__(self, config: SpeculativeConfig, drafter: Drafter, *, max_model_len: int):
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._pace: dict[str, _Pace] = {}

    def drafts(self, candidates: Sequence[Request], num_running: int) -> dict[str, list[int]]:
        """Drafts for the decoding ``candidates`` of a step with ``num_running`` sequences, by
        request id (a sequence that drafts nothing this step is absent)."""
        if num_running > self.config.disable_by_batch_size:
            return {}
        chosen: list[Request] = []
        limits: list[int] = []
        for request in candidates:
            limit = self._limit(request)
            if limit > 0:
                chosen.append(request)
                limits.append(limit)
        if not chosen:
            return {}
        out: dict[str, list[int]] = {}
        for request, draft, limit in zip(chosen, self.drafter.propose(chosen, limits), limits):
            draft = grammar_prefix(request, draft[:limit])
            if draft:
                out[request.request_id] = draft
        return out

    def _limit(self, request: Request) -> int:
        """The most tokens ``request`` may draft now (0: none this step)."""
        if request.deferred_matcher is not None:  # its grammar starts at a token not yet seen
            return 0
        if request.matcher is not None and not can_walk_drafts(request.matcher):
            return 0
        pace = self._pace.get(request.request_id)
        if pace is None:
            pace = self._pace[request.request_id] = _Pace(self.config.num_speculative_tokens)
        if pace.skip > 0:
            pace.skip -= 1
            return 0
        # A step emits drafts plus one token of the target's own: leave room for it.
        room = min(
            request.params.max_tokens - len(request.output_token_ids),
            self.max_model_len - request.num_tokens,
        )
        return min(pace.k, room - 1, self._grammar_room(request))

    @staticmethod
    def _grammar_room(request: Request) -> int:
        """The most drafts whose rows' masks, filled one after another, take no longer than
        one row's budget, at the cost the sequence's slowest fill had at its last step (a slow
        matcher drafts little or nothing: every drafted row is a fill the step waits for)."""
        share = request.mask_fill_share
        return int(1 / share) - 1 if share > 0 else MAX_DRAFTS_UNTIMED

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified step of ``request_id``: ``accepted`` of its ``drafted`` tokens held."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += accepted
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
        pace = self._pace.get(request_id)
        if pace is None:
            return
        most = self.config.num_speculative_tokens
        pace.k = min(most, 2 * pace.k) if accepted == drafted else min(most, accepted + 1)
        pace.rate = 0.5 * pace.rate + 0.5 * accepted / drafted
        if pace.rate < MIN_ACCEPTANCE:
            pace.skip, pace.pause = pace.pause, min(2 * pace.pause, MAX_PAUSE_STEPS)
            pace.rate = MIN_ACCEPTANCE  # the next draft after the pause decides afresh
        elif accepted:
            pace.pause = 1

    def release(self, request_id: str) -> None:
        """Forget a sequence that ended."""
        self._pace.pop(request_id, None)
        self.drafter.release(request_id)


def grammar_prefix(request: Request, draft: list[int]) -> list[int]:
    """The longest prefix of ``draft`` the request's grammar accepts (all of it without one);
    the matcher is left as it was."""
    matcher = request.matcher
    if matcher is None or not draft:
        return draft
    taken = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        taken += 1
        if matcher.is_terminated():  # the grammar ends at this token: the target decides it
            matcher.rollback(1)
            taken -= 1
            break
    if taken:
        matcher.rollback(taken)
    return draft[:taken]
