"""Speculation changes a grammar request's speed, never its outcome: the same tokens, or the
same error after the same tokens, with drafting on or off, for grammars whose masks cost
nothing, a fair share of the budget on every row, or more than the budget from some token on;
and the pool is whole after each.

The matchers are xgrammar's, made to spend a set amount of thread CPU time before each fill
(``CostlyMatcher``), so where a mask outgrows ``--grammar-fill-timeout`` is exact, not left to
the machine's speed. The drafts are the tokens the unspeculated run produced, wrong at every
seventh position (``ScriptedDrafter``), so drafted steps of every length are verified.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
import torch

from paged_serve.engine import SamplingParams
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean, tokenizer_engine
from tests.engine.spec.test_speculative import ScriptedDrafter, spec_config

FILL_TIMEOUT_S = 0.5
DRAFTS = 8  # a drafted step's 9 rows, filled one after another, exceed one row's budget
GRAMMAR = StructuredOutput("grammar", 'root ::= [a-z ]+ "."\n')
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, structured_output=GRAMMAR),
    SamplingParams(max_tokens=24, temperature=0.8, seed=5, structured_output=GRAMMAR),
]


class CostlyMatcher:
    """An xgrammar matcher whose every fill first spins ``cost(n)`` seconds of thread CPU time,
    ``n`` the tokens it holds (accepted, less those rolled back)."""

    def __init__(self, matcher: object, cost: Callable[[int], float]):
        self.matcher, self.cost, self.held = matcher, cost, 0

    def accept_token(self, token: int) -> bool:
        accepted = self.matcher.accept_token(token)
        self.held += int(accepted)
        return accepted

    def rollback(self, count: int) -> None:
        self.matcher.rollback(count)
        self.held -= count

    def fork(self) -> CostlyMatcher:
        twin = CostlyMatcher(self.matcher.fork(), self.cost)
        twin.held = self.held
        return twin

    def fill_next_token_bitmask(self, mask: torch.Tensor, index: int = 0) -> None:
        end = time.thread_time() + self.cost(self.held)
        while time.thread_time() < end:
            pass
        self.matcher.fill_next_token_bitmask(mask, index)

    def __getattr__(self, name: str) -> object:
        return getattr(self.matcher, name)


COSTS = {
    "free": lambda n: 0.0,
    # each fill well inside the budget (with room for a busy machine's wall-clock time); a
    # drafted step's rows together are not
    "a sixth of the budget": lambda n: 0.08,
    # past the budget from the 12th output token on: fails there, drafted or not
    "too costly from token 12": lambda n: 0.01 if n < 12 else 1.2,
}


def _engine(tokenizer, cost: Callable[[int], float], speculate: bool) -> LLMEngine:
    spec = spec_config(num_speculative_tokens=DRAFTS) if speculate else None
    engine = tokenizer_engine(
        tokenizer, seed=3, grammar_fill_timeout_s=FILL_TIMEOUT_S, speculative_config=spec
    )
    plain_matcher = engine.grammars.matcher
    engine.grammars.matcher = lambda compiled: CostlyMatcher(plain_matcher(compiled), cost)
    return engine


def _outcomes(engine: LLMEngine) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Both requests to the end: (tokens, finish reason, error with its milliseconds blanked)."""
    for i, params in enumerate(PARAMS):
        engine.add_request("Say a sentence:", params, request_id=f"r{i}")
    got: dict[str, tuple[list[int], str | None, str | None]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens, _, _ = got.get(out.request_id, ([], None, None))
            error = re.sub(r"took \d+ ms", "took N ms", out.error) if out.error else None
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, error)
    assert_pool_clean(engine.block_manager)
    return got


@pytest.mark.parametrize("cost", list(COSTS), ids=list(COSTS))
def test_speculation_changes_no_outcome_of_a_costly_grammar(default_tokenizer, cost: str):
    plain = _engine(default_tokenizer, COSTS[cost], speculate=False)
    try:
        want = _outcomes(plain)
    finally:
        plain.shutdown()
    if cost == "too costly from token 12":
        for tokens, reason, error in want.values():
            assert reason == "error" and len(tokens) == 12
            assert "took N ms to compute after 12 tokens" in error
    else:
        assert all(error is None for _, _, error in want.values())
    drafted = _engine(default_tokenizer, COSTS[cost], speculate=True)
    drafted.speculator.drafter = ScriptedDrafter(
        {rid: tokens for rid, (tokens, _, _) in want.items()}, len(default_tokenizer)
    )
    try:
        assert _outcomes(drafted) == want
        assert drafted.speculator.stats.num_draft_tokens > 0
    finally:
        drafted.shutdown()
