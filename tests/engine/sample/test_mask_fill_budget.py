"""A grammar whose mask grows costly fails alone; the other rows of its steps go on.

``root ::= w w ... w`` with ``w ::= [^"]*`` compiles at once, but every token it accepts makes
the next mask fill slower (issue 31 item 2: 18 ms at the first token, seconds by the 27th,
stalling every request beside it). The engine fills masks on ``MaskFiller``'s threads with a
per-row budget: that request ends with an error naming the limit, the plain request beside it
gets exactly the tokens it gets alone, and the pool is whole.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from paged_serve.engine import SamplingParams
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sample.token_mask import MASK_FILL_THREADS, MaskFiller
from tests.conftest import assert_pool_clean, tokenizer_engine

EOS = 2
SLOW_GRAMMAR = "root ::= " + " ".join(["w"] * 2000) + '\nw ::= [^"]*\n'


@pytest.fixture(scope="module")
def budget_engine(default_tokenizer) -> LLMEngine:
    engine = tokenizer_engine(default_tokenizer, seed=3, grammar_fill_timeout_s=0.05)
    yield engine
    engine.shutdown()


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Step until idle: (tokens, finish_reason, error) per request id."""
    acc: dict[str, tuple[list[int], str | None, str | None]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens, _, _ = acc.get(out.request_id, ([], None, None))
            acc[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    return acc


def test_a_grammar_whose_mask_outgrows_the_budget_fails_alone(budget_engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    budget_engine.add_request("The sky is", plain, "alone")
    alone = run(budget_engine)["alone"]

    slow = SamplingParams(
        max_tokens=64,
        temperature=1.0,
        seed=0,
        ignore_eos=True,
        structured_output=StructuredOutput("grammar", SLOW_GRAMMAR),
    )
    budget_engine.add_request("Say anything:", slow, "slow")
    budget_engine.add_request("The sky is", plain, "plain")
    results = run(budget_engine)

    tokens, reason, error = results["slow"]
    assert reason == "error" and "too expensive to follow" in error
    assert "--grammar-fill-timeout" in error and len(tokens) < 64
    assert results["plain"] == alone  # same tokens, finished by length, no error
    assert_pool_clean(budget_engine.block_manager)


def test_a_cheap_grammar_keeps_its_budget(budget_engine):
    constraint = StructuredOutput.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    )
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=1, structured_output=constraint)
    for i in range(3):
        budget_engine.add_request("JSON:", params, f"json{i}")
    for _, (tokens, reason, error) in run(budget_engine).items():
        assert error is None and reason in ("stop", "length") and tokens
    assert_pool_clean(budget_engine.block_manager)


class _SpinningMatcher:
    """Fills after ``seconds`` of CPU work (thread CPU time counts it), every bit set to
    ``word``'s."""

    def __init__(self, seconds: float, word: int):
        self.seconds, self.word = seconds, word

    def fill_next_token_bitmask(self, mask: torch.Tensor, index: int) -> None:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        mask[index] = self.word


def _row(matcher: object | None) -> SimpleNamespace:
    return SimpleNamespace(matcher=matcher, output_token_ids=[1, 2, 3])


def test_late_rows_fail_and_queued_rows_fill_on_the_engine_thread():
    """Every filler thread busy with a slow row: those rows come back late, the fast row queued
    behind them is filled by the caller, the unconstrained row is all ones."""
    filler = MaskFiller(fill_timeout_s=0.05)
    slow = [_row(_SpinningMatcher(0.5, 0)) for _ in range(MASK_FILL_THREADS)]
    rows = [_row(None), *slow, _row(_SpinningMatcher(0.0, 5))]
    try:
        mask, late = filler.start(rows, vocab_size=64).wait()
    finally:
        filler.shutdown()
    assert sorted(late) == list(range(1, 1 + MASK_FILL_THREADS))
    assert all("after 3 tokens" in message for message in late.values())
    assert mask[0].tolist() == [-1, -1] and mask[-1].tolist() == [5, 5]


def test_a_fill_that_ended_over_budget_is_late_too():
    filler = MaskFiller(fill_timeout_s=0.02)
    rows = [_row(_SpinningMatcher(0.06, 7)), _row(_SpinningMatcher(0.0, 9))]
    try:
        pending = filler.start(rows, vocab_size=32)
        time.sleep(0.2)  # both fills end before the wait starts
        mask, late = pending.wait()
    finally:
        filler.shutdown()
    assert list(late) == [0] and "the limit is 20 ms" in late[0]
    assert mask[1].tolist() == [9]


def test_no_constrained_row_no_mask():
    assert MaskFiller(0.1).start([_row(None)], vocab_size=32).wait() == (None, {})
