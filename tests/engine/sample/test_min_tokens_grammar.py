"""``min_tokens`` beside a grammar, in the engine: EOS is held back while the grammar may go on,
and the grammar wins where it allows nothing but its end (the request stops with the
constrained answer, short of ``min_tokens``), instead of failing for want of a token.

A random-weight Llama over the default tokenizer's vocabulary, with a logit bias that makes EOS
the likeliest token at every step: without ``min_tokens`` each reply ends as soon as it may.
"""

from __future__ import annotations

import re

import pytest

from paged_serve.engine import SamplingParams
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean, tokenizer_engine

EOS = 2


@pytest.fixture(scope="module")
def random_engine(default_tokenizer) -> LLMEngine:
    return tokenizer_engine(default_tokenizer, seed=5)


def run(engine: LLMEngine) -> dict[str, tuple[list[int], str, str, str | None]]:
    """Step until idle: (tokens, text, finish_reason, error) per request id."""
    acc: dict[str, tuple[list[int], str, str, str | None]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens, text, _, _ = acc.get(out.request_id, ([], "", "", None))
            acc[out.request_id] = (
                tokens + out.new_token_ids,
                text + out.new_text,
                out.finish_reason or "",
                out.error,
            )
    return acc


def params(constraint: StructuredOutput, **fields) -> SamplingParams:
    return SamplingParams(
        structured_output=constraint, logit_bias=((EOS, 100.0),), max_tokens=8, **fields
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_must_end_wins_over_min_tokens(random_engine, temperature):
    choice = StructuredOutput("choice", choices=("yes", "no"))
    for n in range(3):
        random_engine.add_request(
            "Answer:", params(choice, min_tokens=3, temperature=temperature, seed=n), f"r{n}"
        )
    results = run(random_engine)
    for tokens, text, reason, error in results.values():
        assert (reason, error) == ("stop", None)
        assert text in ("yes", "no") and tokens[-1] == EOS
        if temperature == 0.0:  # greedy writes the answer as one token: short of 3, then EOS
            assert len(tokens) == 2
    assert_pool_clean(random_engine.block_manager)


def test_min_tokens_still_holds_eos_back_while_the_grammar_may_go_on(random_engine):
    """``a{1,6}`` may end after any ``a``: EOS (biased to win) waits for 3 tokens, unless the
    six ``a`` leave the grammar nothing but its end first."""
    regex = StructuredOutput("regex", "a{1,6}")
    random_engine.add_request("Say a:", params(regex, min_tokens=3, temperature=0.0), "held")
    random_engine.add_request("Say a:", params(regex, temperature=0.0), "free")
    results = run(random_engine)
    tokens, text, reason, error = results["held"]
    assert (reason, error) == ("stop", None) and re.fullmatch("a{1,6}", text)
    assert len(tokens) >= 4 or text == "a" * 6
    free_tokens, free_text, _, _ = results["free"]
    assert len(free_tokens) == 2 and re.fullmatch("a+", free_text)  # one token, then EOS


def test_a_stop_id_the_grammar_requires_is_not_held_back_into_nothing(
    random_engine, default_tokenizer
):
    """The grammar's only next token (``!``, one character: one token) is one of the request's
    stop_token_ids: the request stops on it rather than fail."""
    [bang] = default_tokenizer.encode("!", add_special_tokens=False)
    choice = StructuredOutput("choice", choices=("!",))
    random_engine.add_request(
        "Answer:",
        params(choice, min_tokens=3, temperature=0.0, stop_token_ids=(bang,)),
        "stopped",
    )
    [(tokens, _, reason, error)] = run(random_engine).values()
    assert (tokens, reason, error) == ([bang], "stop", None)
    assert_pool_clean(random_engine.block_manager)
