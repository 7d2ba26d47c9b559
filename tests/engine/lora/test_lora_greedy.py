"""LoRA adapters made by peft: greedy tokens equal peft's merged model (fp32, Hugging Face's own
forward) for every adapter, alone and in batches mixing the base model and three adapters over
two slots, chunked, preempted, on prefix-cache hits (never across adapters), with n > 1 and
with speculative decoding; and the pool and the adapter slots clean after every scenario.

Two families: Llama (the engine's model body, our fused ``qkv_proj``/``gate_up_proj`` split into
parts) and Phi-3 (Hugging Face's forward, the family's own fused projections adapted whole).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.spec.config import SpeculativeConfig
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.engine.spec.test_speculative import ScriptedDrafter
from tests.lora_adapters import make_adapter

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 40]
RANKS = {"a0": 4, "a1": 8, "a2": 16}


def tiny_phi3() -> Phi3ForCausalLM:
    config = Phi3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Phi3ForCausalLM(config).eval()


FAMILIES = {
    "llama": (lambda: tiny_model("llama"), None),
    "phi3": (tiny_phi3, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(base model, adapter folders by name, prompts, expected tokens by (name, prompt index));
    name None is the base model."""
    build, targets = FAMILIES[request.param]
    base = build()
    folder = tmp_path_factory.mktemp(f"adapters-{request.param}")
    merged = {
        name: make_adapter(base, folder / name, seed=i, rank=rank, targets=targets)
        for i, (name, rank) in enumerate(RANKS.items())
    }
    merged[None] = base
    prompts = random_prompts(LENGTHS, seed=1)
    want = {
        (name, i): hf_greedy(model, prompt, MAX_TOKENS)
        for name, model in merged.items()
        for i, prompt in enumerate(prompts)
    }
    return base, {name: folder / name for name in RANKS}, prompts, want


def engine_for(served, **config: object) -> LLMEngine:
    base, folders, _, _ = served
    lora = LoRAConfig(
        max_loras=config.pop("max_loras", 2),
        max_lora_rank=16,
        modules=tuple(LoRAModule(name, str(path)) for name, path in folders.items()),
    )
    settings = {"kv_cache_memory": 4 << 20, "lora": lora, **config}
    return LLMEngine(EngineConfig(**settings), loaded=loaded(base))


def run(engine: LLMEngine, requests: list[tuple[str | None, int]], prompts, params=GREEDY):
    """Every ``(adapter, prompt index)`` at once; tokens by request id ``name-index``."""
    for name, i in requests:
        engine.add_request(prompts[i], params, request_id=f"{name}-{i}", lora=name)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert_clean(engine)
    return got


def assert_clean(engine: LLMEngine) -> None:
    assert_pool_clean(engine.block_manager)
    engine.scheduler.check_adapter_slots()
    assert not engine.scheduler.adapter_slots.users_by_name()


def test_adapters_change_the_tokens(served):
    """The test data can fail: every adapter's tokens differ from the base's and each other's."""
    _, _, prompts, want = served
    for i in range(len(prompts)):
        runs = [tuple(want[(name, i)]) for name in (None, *RANKS)]
        assert len(set(runs)) == len(runs)


def test_each_adapter_alone_equals_peft_merged(served):
    _, _, prompts, want = served
    engine = engine_for(served)
    for name in (None, *RANKS):
        for i in range(len(prompts)):
            got = run(engine, [(name, i)], prompts)
            assert got[f"{name}-{i}"] == want[(name, i)], (name, i)


def test_base_and_three_adapters_mixed_over_two_slots(served):
    """Three adapters, two slots: requests wait for a slot in their queue order; every batch
    mixes the base model with up to two adapters."""
    _, _, prompts, want = served
    engine = engine_for(served, max_loras=2)
    requests = [(name, i) for i in range(len(prompts)) for name in (None, *RANKS)]
    got = run(engine, requests, prompts)
    assert {key: got[f"{key[0]}-{key[1]}"] for key in want} == want


def test_chunked_prefill_and_preemption(served):
    """A budget of 8 tokens a step chunks every prompt; a pool of 6 blocks preempts."""
    base, _, prompts, want = served
    config = base.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block = config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * head_dim * 4
    engine = engine_for(served, max_num_batched_tokens=8, kv_cache_memory=6 * block)
    requests = [(name, i) for i in range(len(prompts)) for name in (None, "a0", "a2")]
    got = run(engine, requests, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert all(got[f"{n}-{i}"] == want[(n, i)] for n, i in requests)


def test_prefix_cache_hits_only_within_one_adapter(served):
    """The same 40-token prompt under the base model, then adapter a1 twice: a1's first run
    gets no hit from the base's blocks, its second hits its own."""
    _, _, prompts, want = served
    engine = engine_for(served)
    cached = {}
    for name, rid in ((None, "base"), ("a1", "first"), ("a1", "again")):
        engine.add_request(prompts[2], GREEDY, request_id=rid, lora=name)
        tokens = []
        while engine.has_unfinished:
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finished:
                    cached[rid] = out.num_cached_tokens
        assert tokens == want[(name, 2)]
    assert cached == {"base": 0, "first": 0, "again": 32}
    assert_clean(engine)


def test_n_samples_share_the_adapter(served):
    _, _, prompts, want = served
    engine = engine_for(served)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    got = run(engine, [("a2", 1), (None, 1)], prompts, params)
    assert got["a2-1"] == got["a2-1.1"] == want[("a2", 1)]
    assert got["None-1"] == got["None-1.1"] == want[(None, 1)]


def test_speculative_decoding_verifies_with_the_adapter(served):
    """Drafts of each request's own answer, wrong at every 7th position (so runs of 0..k are
    accepted), verified by the request's adapter: the tokens stay the adapter's."""
    base, _, prompts, want = served
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    engine = engine_for(served, speculative_config=spec)
    requests = [("a1", 0), (None, 1), ("a2", 2)]
    answers = {f"{n}-{i}": want[(n, i)] for n, i in requests}
    engine.speculator.drafter = ScriptedDrafter(answers, int(base.config.vocab_size))
    got = run(engine, requests, prompts)
    assert got == answers
    assert (
        0 < engine.speculator.stats.num_accepted_tokens < engine.speculator.stats.num_draft_tokens
    )
