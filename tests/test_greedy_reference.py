"""The float64 greedy comparison (``tests/greedy_reference.py``) passes a faithful run and
fails a run off by more than its tolerance, a wrong token, and data with a near-tie."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_serve.engine.outputs import CompletionResult, TokenLogprob
from tests.conftest import random_prompts, tiny_model
from tests.greedy_reference import (
    LOGPROB_TOL,
    GreedyReference,
    assert_greedy_within_tolerance,
    float64_copy,
    greedy_reference,
)


@pytest.fixture(scope="module")
def reference() -> GreedyReference:
    model64 = float64_copy(tiny_model("llama", seed=1))
    return greedy_reference(model64, random_prompts([9], seed=2)[0], 6)


def run_like(ref: GreedyReference, *, tokens=None, error: float = 0.0) -> CompletionResult:
    tokens = list(ref.tokens) if tokens is None else tokens
    entries = [TokenLogprob(t, float(ref.logprobs[i, t]) + error) for i, t in enumerate(tokens)]
    return CompletionResult("r", [], token_ids=tokens, logprobs=entries)


def test_a_faithful_run_passes(reference):
    assert (reference.margins > 2 * LOGPROB_TOL).all()
    assert_greedy_within_tolerance(run_like(reference, error=0.5 * LOGPROB_TOL), reference)


def test_a_run_off_by_more_than_the_tolerance_fails(reference):
    with pytest.raises(AssertionError, match="step 0: logprob"):
        assert_greedy_within_tolerance(run_like(reference, error=3 * LOGPROB_TOL), reference)


def test_a_wrong_token_fails(reference):
    tokens = list(reference.tokens)
    tokens[2] = int(reference.logprobs[2].topk(2).indices[1])  # the runner-up
    with pytest.raises(AssertionError, match="step 2: not float64's best"):
        assert_greedy_within_tolerance(run_like(reference, tokens=tokens), reference)


def test_data_with_a_near_tie_is_refused(reference):
    logprobs = reference.logprobs.clone()
    best, second = logprobs[1].topk(2).indices.tolist()
    logprobs[1, second] = logprobs[1, best] - LOGPROB_TOL
    tied = dataclasses.replace(reference, logprobs=logprobs)
    assert torch.equal(tied.logprobs.argmax(-1), reference.logprobs.argmax(-1))
    with pytest.raises(AssertionError, match=r"near-ties at steps \[1\]"):
        assert_greedy_within_tolerance(run_like(tied), tied)
