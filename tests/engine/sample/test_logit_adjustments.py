"""Logit bias and the repetition, frequency and presence penalties: the rule against a
per-token loop, greedy tokens against Hugging Face ``generate(repetition_penalty=...)`` and
against a step-by-step full-forward oracle, raw logprobs, and validation."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.sample.logit_adjustments import adjust_logits, penalize
from paged_serve.engine.sched.request import Request
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([3, 12, 30, 17], seed=21)
MAX_TOKENS = 16


def penalize_loop(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: list[float],
    frequency: list[float],
    presence: list[float],
) -> torch.Tensor:
    """The rule of ``engine/penalties.py``, one token at a time, in float64."""
    out = logits.double().clone()
    for row, (prompt, output) in enumerate(zip(prompt_ids, output_ids)):
        for token in set(prompt) | set(output):
            x = out[row, token]
            out[row, token] = x / repetition[row] if x > 0 else x * repetition[row]
        for token in set(output):
            out[row, token] -= frequency[row] * output.count(token) + presence[row]
    return out


def test_penalize_matches_the_per_token_rule():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab, generator=gen) * 3
    prompt_ids = [[1, 2, 2, 7], [], [5] * 6, [0, 49]]
    output_ids = [[2, 3, 3, 3], [9, 9, 10], [], [49, 49, 0, 8]]
    rules = dict(
        repetition=[1.3, 1.0, 0.7, 2.0],
        frequency=[0.5, -1.0, 2.0, 0.0],
        presence=[0.2, 1.5, -2.0, 0.4],
    )
    got = penalize(logits, prompt_ids=prompt_ids, output_ids=output_ids, **rules)
    want = penalize_loop(logits, prompt_ids, output_ids, **rules)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    untouched = [t for t in range(vocab) if t not in {0, 1, 2, 3, 7, 8, 49}]
    assert torch.equal(got[0, untouched], logits[0, untouched]) and torch.equal(
        got[2, 6:], logits[2, 6:]
    )


@torch.inference_mode()
def oracle_greedy(
    model, prompt: list[int], max_new_tokens: int, params: SamplingParams
) -> list[int]:
    """Full forward over prompt + outputs at every step, bias, the loop rule, argmax."""
    output: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([prompt + output])).logits[0, -1:].float()
        for token, bias in params.logit_bias:
            logits[0, token] += bias
        scores = penalize_loop(
            logits,
            [prompt],
            [output],
            [params.repetition_penalty],
            [params.frequency_penalty],
            [params.presence_penalty],
        )
        output.append(int(scores.argmax()))
    return output


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_repetition_penalty_equals_hf_generate(family):
    """Penalised and plain requests batched together, chunked: each equals its HF reference."""
    model = tiny_model(family, seed=3)
    penalised = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.8, ignore_eos=True
    )
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    params = [penalised, plain, penalised, plain]
    want = [
        hf_greedy(model, p, MAX_TOKENS, repetition_penalty=1.8)
        if s is penalised
        else hf_greedy(model, p, MAX_TOKENS)
        for p, s in zip(PROMPTS, params)
    ]
    assert want[0] != hf_greedy(model, PROMPTS[0], MAX_TOKENS)  # the penalty matters here
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=16)
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_frequency_and_presence_penalties_equal_the_oracle():
    model = tiny_model("mistral", seed=8)
    cases = [
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.8, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=0.0,
            frequency_penalty=-0.5,
            presence_penalty=0.7,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    want = [oracle_greedy(model, p, 12, s) for p, s in zip(PROMPTS, cases)]
    assert want[3] == hf_greedy(model, PROMPTS[3], 12)  # the oracle without penalties is HF
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    assert [r.token_ids for r in llm.generate(PROMPTS, cases)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_logprobs_are_the_models_own():
    """With a penalty changing the choice, the reported logprobs are still raw log-softmax."""
    model = tiny_model("qwen2", seed=6)
    prompt = PROMPTS[1]
    params = SamplingParams(
        max_tokens=8, temperature=0.0, repetition_penalty=2.0, logprobs=2, ignore_eos=True
    )
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    [result] = llm.generate([prompt], params)
    tokens = result.token_ids
    assert tokens != hf_greedy(model, prompt, 8)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    raw = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # the row each token came from
    for step, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(raw[step, tokens[step]].item(), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert top_ids == raw[step].topk(2).indices.tolist()
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
    ],
)
def test_bad_penalties_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_then_penalties_equal_the_oracle():
    """Bias alone, and bias with penalties (the order matters: bias first, as in vLLM)."""
    model = tiny_model("llama", seed=12)
    plain = hf_greedy(model, PROMPTS[2], 10)
    bias = {plain[0]: -8.0, 7: 3.5, 100: 2.0}
    cases = [
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias, ignore_eos=True),
        SamplingParams(
            max_tokens=10,
            temperature=0.0,
            logit_bias=bias,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            ignore_eos=True,
        ),
    ]
    want = [oracle_greedy(model, PROMPTS[2], 10, s) for s in cases]
    assert want[0][0] != plain[0]  # the bias changed the first choice
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    assert [r.token_ids for r in llm.generate([PROMPTS[2]] * 2, cases)] == want
    forced = SamplingParams(max_tokens=5, temperature=0.7, seed=3, logit_bias={42: 100})
    assert llm.generate([PROMPTS[0]], forced)[0].token_ids == [42] * 5
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"7": 1.0}, "logit_bias keys must be token ids"),
        ({7: 100.5}, "logit_bias values must be in"),
        ({-1: 1.0}, "logit_bias keys must be token ids"),
        ([(3, 1.0), (3, 2.0)], "logit_bias has a token id twice"),
    ],
)
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused():
    llm = LLM(loaded=loaded(tiny_model("llama")), kv_cache_memory=1 << 20)
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token {vocab} is outside"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished
    assert_pool_clean(llm.engine.block_manager)


def test_bias_comes_before_the_penalties_and_untouched_rows_stay():
    """Token 3 is in the prompt with logit 1: bias +2 then repetition 2 gives (1 + 2) / 2 = 1.5
    (the other order would give 1 / 2 + 2 = 2.5); the row asking for nothing is the same row."""
    logits = torch.zeros(2, 8)
    logits[:, 3] = 1.0
    asks = SamplingParams(logit_bias={3: 2.0, 5: -1.0}, repetition_penalty=2.0)
    rows = [Request("a", [3, 4], asks, seed=0), Request("b", [3, 4], SamplingParams(), seed=0)]
    out = adjust_logits(logits, rows)
    assert out[0].tolist() == [0.0, 0.0, 0.0, 1.5, 0.0, -1.0, 0.0, 0.0]  # token 4: 0 * 2 = 0
    assert torch.equal(out[1], logits[1])
    assert adjust_logits(logits, [rows[1], rows[1]]) is logits  # nothing asked: no copy
