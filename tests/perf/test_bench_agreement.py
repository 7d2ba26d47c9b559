"""perf.engine.bench_agreement's teacher forcing: the engine is fed the reference tokens, and its
own greedy picks are counted against them, on a tiny fp32 model (whose tokens are HF's
exactly)."""

from __future__ import annotations

import torch

from paged_serve.engine.llm import LLM
from perf.engine.bench_agreement import forced_agreement
from tests.conftest import (
    TINY_VOCAB,
    assert_pool_clean,
    hf_greedy,
    loaded,
    random_prompts,
    tiny_model,
)

PROMPTS = random_prompts([5, 17, 9], seed=3)
STEPS = [6, 3, 8]


def _forced(model, references):
    llm = LLM(loaded=loaded(model))
    result, fed = forced_agreement(llm.engine, PROMPTS, references)
    assert fed == references  # every step was fed the reference token
    assert result.positions == sum(len(r) for r in references)
    assert_pool_clean(llm.engine.block_manager)
    return result


def test_hf_own_tokens_agree_everywhere() -> None:
    model = tiny_model("llama")
    references = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, STEPS)]
    result = _forced(model, references)
    assert (result.agreed, result.flips, result.rate) == (result.positions, [], 1.0)


def test_a_changed_token_is_one_flip_at_its_position() -> None:
    model = tiny_model("llama")
    references = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, STEPS)]
    references[0][-1] = (references[0][-1] + 1) % TINY_VOCAB
    result = _forced(model, references)
    assert result.flips == [(0, STEPS[0] - 1)]
    assert result.agreed == result.positions - 1


@torch.inference_mode()
def test_each_pick_is_made_from_the_forced_prefix() -> None:
    """With arbitrary references, the engine's pick at position j is HF's greedy next token
    after the prompt and the first j reference tokens (one HF forward over it all)."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(7)
    references = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in STEPS]
    expected = []
    for i, (prompt, reference) in enumerate(zip(PROMPTS, references)):
        logits = model(torch.tensor([prompt + reference])).logits[0]
        picks = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        expected += [(i, j) for j, pick in enumerate(picks) if pick != reference[j]]
    result = _forced(model, references)
    assert sorted(result.flips) == sorted(expected)
    assert result.rate == round(1 - len(expected) / result.positions, 4)
