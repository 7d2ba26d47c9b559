"""Prefix caching for models with state slots (gated DeltaNet, Mamba-2, short convolutions):
a conversation's next turn resumes from the longest cached block boundary that has a state
snapshot, and its greedy tokens equal Hugging Face's over the whole conversation (which an
uncached run gives too). Snapshots every 16 tokens (one block), so the tiny prompts cross
several. Forks of a resumed prompt, preemption with snapshots, and a snapshot interval of 0
(no hits) are checked too; the pool, the slots and the snapshot rows are intact after each.
"""

from __future__ import annotations

import pytest

from paged_serve.engine import LLM, SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts
from tests.engine.model.test_model_coverage import tiny_architecture
from tests.engine.model.test_state_space_models import reference

FIRST = random_prompts([40], seed=9)[0]
NEXT = random_prompts([7], seed=10)[0]
ANSWER = 20  # tokens of the first turn's answer


def _model(name: str):
    return tiny_architecture(name) if name.startswith("qwen") else reference(name)[0]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "bamba", "nemotron_h", "lfm2"])
def conversation(request: pytest.FixtureRequest):
    """The model, its first turn's answer, the second turn's prompt and HF's answer to it."""
    model = _model(request.param)
    answer = hf_greedy(model, FIRST, ANSWER)
    turn2 = FIRST + answer + NEXT
    return model, answer, turn2, hf_greedy(model, turn2, 8)


def _llm(model, **kwargs) -> LLM:
    settings = dict(kv_cache_memory=4 << 20, max_num_seqs=4, state_snapshot_interval=16)
    return LLM(loaded=loaded(model), **{**settings, **kwargs})


def test_the_next_turn_resumes_from_a_snapshot(conversation) -> None:
    """Turn 1 (40 prompt tokens in 24-token chunks, 20 drawn) keeps states at 16, 32 and 48
    tokens; turn 2 (67 tokens) resumes after 48 cached ones and keeps one more at 64."""
    model, answer, turn2, want = conversation
    llm = _llm(model, max_num_batched_tokens=24)
    greedy = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    [first] = llm.generate([FIRST], greedy)
    assert first.token_ids == answer
    [second] = llm.generate([turn2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert second.token_ids == want
    assert second.metrics.num_cached_tokens == 48
    snapshots = llm.engine.block_manager.snapshots
    assert snapshots.restores_total == 1 and snapshots.saves_total == 4
    assert_pool_clean(llm.engine.block_manager)


def test_forks_of_a_resumed_prompt(conversation) -> None:
    """n = 2 seeded samples of a prompt that resumed from a snapshot equal the same samples
    drawn without prefix caching."""
    model, _, turn2, _ = conversation
    params = SamplingParams(n=2, seed=5, max_tokens=6, temperature=1.0, ignore_eos=True)
    llm = _llm(model)
    llm.generate([turn2[:50]], SamplingParams(max_tokens=1))
    resumed = llm.generate([turn2], params)
    assert resumed[0].metrics.num_cached_tokens == 48
    plain = _llm(model, enable_prefix_caching=False).generate([turn2], params)
    assert [r.token_ids for r in resumed] == [r.token_ids for r in plain]
    assert_pool_clean(llm.engine.block_manager)


def test_without_an_interval_nothing_hits(conversation) -> None:
    model, _, turn2, want = conversation
    llm = _llm(model, state_snapshot_interval=0)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([turn2], greedy)
    [again] = llm.generate([turn2], greedy)
    assert again.token_ids == want and again.metrics.num_cached_tokens == 0
    assert llm.engine.block_manager.snapshots is None
    assert_pool_clean(llm.engine.block_manager)


def test_the_interval_is_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        _llm(reference("lfm2")[0], state_snapshot_interval=24)
