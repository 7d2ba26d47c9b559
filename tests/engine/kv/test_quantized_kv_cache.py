"""A quantized KV cache (``--kv-cache-dtype int8``/``fp8``) through the engine: greedy tokens
equal Hugging Face's own forward over the cache's values (K and V rounded per token and head as
the cache stores them: tests/kv_quant_reference.py), alone, batched, chunked, preempted and on
prefix-cache hits, on the CPU's torch path (plan and C decode kernel) and the Triton kernels
(interpreter); the cache holds codes and scales, more tokens in the same bytes; the pool stays
clean."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.kv.kv_cache import KVCache, cache_layout
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.kv_quant_reference import fake_quant_attention

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([3, 17, 40, 33], seed=5)
CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=2)


@pytest.fixture(scope="module", params=sorted(CODES))
def expected(request, model):
    """(kv-cache-dtype name, HF's greedy tokens over the cache's values per prompt)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(fake_quant_attention(CODES[request.param]))
    return request.param, [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


def run(engine: LLMEngine, prompts=PROMPTS) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert_pool_clean(engine.block_manager)
    return [got[f"r{i}"] for i in range(len(prompts))]


def engine_for(model, name: str, **config: object) -> LLMEngine:
    settings = {"kv_cache_memory": 1 << 20, "kv_cache_dtype": name, **config}
    return LLMEngine(EngineConfig(**settings), loaded=loaded(model))


def test_the_reference_differs_from_the_unquantized_model(model, expected):
    """The data can fail: the rounding changes some token of some prompt (else the tests
    below could not tell a quantized cache from a plain one)."""
    name, want = expected
    plain = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    if name != "int8":  # int8 rounds too finely to flip a tiny model's greedy tokens
        assert plain != want


def test_alone_and_batched(model, expected):
    name, want = expected
    engine = engine_for(model, name)
    assert engine.runner.kv_cache.tensor.dtype == CODES[name]
    assert [run(engine, [p])[0] for p in PROMPTS] == want
    assert run(engine) == want


def test_chunked_and_preempted(model, expected):
    """8 tokens a step chunks every prompt; a pool of 5 blocks preempts; the block copies of
    a fork would carry codes and scales alike."""
    name, want = expected
    layout = cache_layout(model.config)
    block = KVCache.bytes_per_block(num_layers=2, block_size=16, layout=layout, dtype=CODES[name])
    engine = engine_for(model, name, max_num_batched_tokens=8, kv_cache_memory=5 * block)
    assert run(engine) == want
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits(model, expected):
    name, want = expected
    engine = engine_for(model, name)
    assert run(engine, [PROMPTS[2]]) == [want[2]]
    engine.add_request(PROMPTS[2], GREEDY, request_id="again")
    tokens, cached = [], 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    assert tokens == want[2] and cached == 32


def test_triton_kernels(model, expected):
    name, want = expected
    engine = engine_for(model, name, attention_backend="triton", max_num_batched_tokens=24)
    assert run(engine, PROMPTS[:2]) == want[:2]


def test_skipped_layers_keep_the_model_dtype(model):
    """--kv-cache-dtype-skip-layers 0: layer 0 caches fp32 values, layer 1 codes; the tokens
    are HF's with only layer 1's K and V rounded; a fork's copies carry both tensors."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(fake_quant_attention(torch.float8_e5m2, skip=(0,)))
    want = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    engine = engine_for(model, "fp8_e5m2", kv_cache_dtype_skip_layers=(0,))
    cache = engine.runner.kv_cache
    assert cache.layer(0)[0].dtype == torch.float32 and cache.layer_scales(0) is None
    assert cache.layer(1)[0].dtype == torch.float8_e5m2 and cache.layer_scales(1) is not None
    assert len(cache.block_tensors()) == 3
    assert run(engine) == want
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2)
    engine.add_request(PROMPTS[1], params, request_id="fork")
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)


def test_the_cache_holds_more_tokens_in_the_same_bytes(model):
    """Codes of a byte and an fp32 scale per token and KV head: (64 + 4) bytes a token and
    head against fp32's 256."""
    plain = engine_for(model, "auto").runner.kv_cache
    codes = engine_for(model, "int8").runner.kv_cache
    assert codes.scales is not None and codes.scales.dtype == torch.float32
    assert codes.num_tokens // plain.num_tokens == 3  # 256 / 68 = 3.76
    assert codes.num_bytes <= 1 << 20


def test_bad_names_are_refused():
    """An unknown name is refused. (A latent-attention model's cache is served quantized:
    tests/engine/kv/test_quantized_latent_cache.py.)"""
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
