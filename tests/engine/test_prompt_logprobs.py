"""Prompt logprobs equal Hugging Face's full-forward ``log_softmax`` in fp32 (to 1e-4), whether
the prompt is computed in one step or in chunks, preempted, beside ordinary requests, or after
its prefix was cached; ``max_tokens=0`` scores only; ``min_tokens`` holds EOS and stop ids back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([7, 40, 70], seed=4)
TOP = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=2)


@torch.inference_mode()
def hf_prompt_logprobs(model, prompt: list[int]) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's logprob after the ones before it, and the top-3 ids at each place."""
    logits = model(torch.tensor([prompt])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:])
    values = log_probs[:-1].gather(1, targets[:, None])[:, 0]
    return values.tolist(), log_probs[:-1].topk(TOP, dim=-1).indices.tolist()


def run(engine: LLMEngine) -> dict:
    outs: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def check_against_hf(model, prompt: list[int], entries) -> None:
    want, want_top = hf_prompt_logprobs(model, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries[1:]])
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-4, rtol=0)
    assert [[t for t, _ in e.top] for e in entries[1:]] == want_top


def scoring(max_tokens: int = 0, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, prompt_logprobs=TOP, temperature=0.0, **fields)


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_hf(model, budget):
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=4 << 20, max_num_batched_tokens=budget), loaded=loaded(model)
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, scoring(), f"p{i}")
    outs = run(engine)
    for i, prompt in enumerate(PROMPTS):
        [final] = outs[f"p{i}"]  # score only: one output, no tokens
        assert final.finish_reason == "length" and final.new_token_ids == []
        check_against_hf(model, prompt, final.prompt_logprobs)
    assert_pool_clean(engine.block_manager)


def test_prompt_logprobs_beside_ordinary_requests_and_generation(model):
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20), loaded=loaded(model))
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(PROMPTS[0], plain, "plain")
    engine.add_request(PROMPTS[1], scoring(max_tokens=6, ignore_eos=True, n=2), "scored")
    outs = run(engine)
    assert [t for o in outs["plain"] for t in o.new_token_ids] == hf_greedy(model, PROMPTS[0], 6)
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    for rid in ("scored", "scored.1"):
        first, *rest = outs[rid]
        check_against_hf(model, PROMPTS[1], first.prompt_logprobs)  # on the first output only
        assert all(o.prompt_logprobs is None for o in rest)
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        assert tokens == hf_greedy(model, PROMPTS[1], 6)
    assert_pool_clean(engine.block_manager)


def test_prompt_logprobs_survive_preemption(model):
    # 6 blocks of 16 tokens (2 layers x K,V x 16 x 2 KV heads x 64 x fp32 = 32 KiB each).
    engine = LLMEngine(
        EngineConfig(kv_cache_memory=6 * 32768, max_num_batched_tokens=24), loaded=loaded(model)
    )
    prompts = random_prompts([30, 30, 30], seed=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, scoring(max_tokens=20, ignore_eos=True), f"p{i}")
    outs = run(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        check_against_hf(model, prompt, outs[f"p{i}"][0].prompt_logprobs)
        tokens = [t for o in outs[f"p{i}"] for t in o.new_token_ids]
        assert tokens == hf_greedy(model, prompt, 20)
    assert_pool_clean(engine.block_manager)


def test_a_warm_prefix_cache_does_not_skip_scored_positions(model):
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20), loaded=loaded(model))
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=1), "warm")
    run(engine)
    hits_before = engine.scheduler.prefix_hit_tokens
    engine.add_request(PROMPTS[2], scoring(), "scored")
    [final] = run(engine)["scored"]
    assert engine.scheduler.prefix_hit_tokens == hits_before  # it computed its whole prompt
    assert final.num_cached_tokens == 0
    check_against_hf(model, PROMPTS[2], final.prompt_logprobs)
    # Once scored, the same prompt hits the cache again for requests that do not ask.
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=1), "again")
    run(engine)
    assert engine.scheduler.prefix_hit_tokens > hits_before
    assert_pool_clean(engine.block_manager)


def test_min_tokens_holds_back_stop_ids_and_eos(model):
    lm = dataclasses.replace(loaded(model), eos_token_ids=(5,))
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20), loaded=lm)
    pushed = {"logit_bias": {5: 100.0, 9: 50.0}, "stop_token_ids": (9,), "max_tokens": 10}
    engine.add_request(PROMPTS[0], SamplingParams(**pushed), "free")
    engine.add_request(PROMPTS[0], SamplingParams(min_tokens=4, **pushed), "held")
    outs = run(engine)
    free = [t for o in outs["free"] for t in o.new_token_ids]
    held = [t for o in outs["held"] for t in o.new_token_ids]
    assert free == [5]  # EOS at once
    assert len(held) == 5 and held[-1] == 5 and not {5, 9} & set(held[:4])
    assert outs["held"][-1].finish_reason == "stop"
    assert_pool_clean(engine.block_manager)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 \(0 only scores a prompt"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens must be"),
    ],
)
def test_bad_scoring_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
