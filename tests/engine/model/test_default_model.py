"""The embedded default model: lossless GGUF conversion and greedy equality with HF."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.loader import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    gguf_cache_dir,
    load_gguf_float32,
    load_model,
)
from tests.conftest import assert_pool_clean, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
]
MAX_TOKENS = 16


def test_cached_checkpoint_equals_transformers_gguf_loader(default_model):
    """The safetensors cache holds exactly what transformers' GGUF loader gives in fp32."""
    reference, _ = load_gguf_float32(default_gguf_path())
    cached = load_file(str(gguf_cache_dir(default_gguf_path()) / "model.safetensors"))
    want = reference.state_dict()
    assert cached, "empty checkpoint"
    for name, tensor in cached.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, want[name]), name
    # Tied weights are stored once; everything else is present.
    missing = set(want) - set(cached)
    assert missing <= {"lm_head.weight"}
    # A fresh load: engines in other tests prepare (fuse) the shared fixture's model in place.
    fresh = load_model(None, dtype=torch.float32, device=torch.device("cpu"))
    loaded_state = fresh.model.state_dict()
    for name, tensor in want.items():
        assert torch.equal(loaded_state[name], tensor), name


def test_default_model_metadata(default_model):
    assert default_model.name == DEFAULT_MODEL_NAME
    assert default_model.eos_token_ids == (2,)
    assert type(default_model.model).__name__ == "LlamaForCausalLM"
    assert next(default_model.model.parameters()).dtype == torch.float32


@pytest.fixture(scope="module")
def hf_reference(default_model):
    model = copy.deepcopy(default_model.model)
    # Other tests' engines may already have swapped the shared model's attention.
    model.set_attn_implementation("sdpa")
    tok = default_model.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    return prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_greedy_equals_hf_batched_and_alone(default_model, hf_reference):
    prompts, want = hf_reference
    llm = LLM(loaded=default_model, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert llm.generate([prompts[0]], params)[0].token_ids == want[0]
    assert_pool_clean(llm.engine.block_manager)


def test_greedy_equals_hf_chunked_and_preempted(default_model, hf_reference):
    prompts, want = hf_reference
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(loaded=default_model, kv_cache_memory=4 * block_bytes, max_num_batched_tokens=8)
    results = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert [r.token_ids for r in results] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


def test_answers_the_capital_of_france(default_model):
    llm = LLM(loaded=default_model, kv_cache_memory=64 << 20)
    [r] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert r.text.startswith(" Paris")
