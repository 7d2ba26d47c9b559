"""Engine sampling: seeded draws reproducible and batch-independent, top_k=1 is greedy,
logprobs, stop strings and stop token ids; the sampler's token -1 for non-finite rows."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.platform.kernel_backend import fused_sampler
from paged_serve.engine.sample.sampler import Sampler, SamplingBatch
from tests.conftest import assert_pool_clean, loaded, random_prompts, tiny_model


@pytest.fixture(scope="module")
def llm():
    return LLM(loaded=loaded(tiny_model("llama")), kv_cache_memory=4 << 20)


PROMPTS = random_prompts([3, 9, 17, 30], seed=5)


def test_seeded_draws_do_not_depend_on_the_batch(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, seeded, others])
    reordered = llm.generate([PROMPTS[2], PROMPTS[1]], [others, seeded])
    assert batch[1].token_ids == alone == reordered[1].token_ids
    assert_pool_clean(llm.engine.block_manager)


def test_different_seeds_differ(llm):
    runs = {
        tuple(
            llm.generate(
                [PROMPTS[0]],
                SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True),
            )[0].token_ids
        )
        for s in range(4)
    }
    assert len(runs) > 1


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top1 = llm.generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, seed=3, ignore_eos=True)
    )
    assert [r.token_ids for r in greedy] == [r.token_ids for r in top1]


def test_logprobs_are_reported_and_consistent(llm):
    [r] = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    )
    assert len(r.logprobs) == 6
    for tok, entry in zip(r.token_ids, r.logprobs):
        assert entry.token_id == tok
        assert len(entry.top) == 3
        # Greedy: the chosen token is the best alternative, and logprobs are <= 0 and sorted.
        assert entry.top[0][0] == tok
        assert math.isclose(entry.top[0][1], entry.logprob, abs_tol=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))
        assert entry.logprob <= 0


def test_stop_token_ids_finish_with_stop(llm):
    [free] = llm.generate(
        [PROMPTS[3]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    stop_at = free.token_ids[3]
    [r] = llm.generate(
        [PROMPTS[3]],
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True),
    )
    first = free.token_ids.index(stop_at)
    assert r.token_ids == free.token_ids[: first + 1]
    assert r.finish_reason == "stop"


def test_eos_stops_unless_ignored():
    model = tiny_model("qwen2")
    [free] = LLM(loaded=loaded(model), kv_cache_memory=4 << 20).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    eos = free.token_ids[2]
    handle = dataclasses.replace(loaded(model), eos_token_ids=(eos,))
    llm = LLM(loaded=handle, kv_cache_memory=4 << 20)
    [stopped] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    [ignored] = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_strings_cut_the_text_exactly(default_model):
    llm = LLM(loaded=default_model, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=12, temperature=0)
    [free] = llm.generate(["The capital of France is"], params)
    assert "Paris" in free.text
    [cut] = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0, stop=("aris",))
    )
    assert cut.text == free.text[: free.text.index("aris")]
    assert cut.finish_reason == "stop"
    assert_pool_clean(llm.engine.block_manager)


def test_a_huge_top_k_means_no_top_k(llm):
    params = dict(max_tokens=5, temperature=1.0, seed=2, ignore_eos=True)
    [huge] = llm.generate([PROMPTS[0]], SamplingParams(top_k=2**40, **params))
    [off] = llm.generate([PROMPTS[0]], SamplingParams(top_k=0, **params))
    assert huge.token_ids == off.token_ids


def test_vanishing_temperature_and_top_p_mean_the_most_likely_token(llm):
    [greedy] = llm.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    for params in (
        SamplingParams(max_tokens=6, temperature=1e-30, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-45, seed=1, ignore_eos=True),
    ):
        assert llm.generate([PROMPTS[1]], params)[0].token_ids == greedy.token_ids


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
def test_sampler_gives_minus_one_for_non_finite_rows(backend, temperature):
    """NaN, +inf or nothing finite: token -1 and a NaN logprob on every path (the all-greedy
    fast path at temperature 0, the kernel or the reference otherwise); the valid row's token
    is the one it gets alone."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    logits[1, 7] = float("nan")
    logits[2, 250] = float("inf")
    logits[3] = float("-inf")

    def batch(rows: int) -> SamplingBatch:
        return SamplingBatch(
            temperature=torch.full((rows,), temperature),
            top_k=torch.full((rows,), 50, dtype=torch.int32),
            top_p=torch.full((rows,), 0.9),
            min_p=torch.zeros(rows),
            seeds=torch.full((rows,), 42, dtype=torch.int64),
            steps=torch.full((rows,), 3, dtype=torch.int64),
            all_greedy=temperature == 0,
        )

    sampler = Sampler(fused_sampler(backend))
    tokens, logprobs = sampler.draw(logits, batch(4))
    assert tokens[1:].tolist() == [-1, -1, -1]
    assert logprobs[1:].isnan().all()
    alone, alone_logprob = sampler.draw(logits[:1], batch(1))
    assert tokens[0] == alone[0] >= 0 and logprobs[0] == alone_logprob[0]
    if temperature == 0:
        assert tokens[0] == logits[0].argmax()
