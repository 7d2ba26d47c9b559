"""A quantized latent cache (``--kv-cache-dtype int8``/``fp8`` on a multi-head latent attention
model, tiny DeepSeek-V3): greedy tokens equal Hugging Face's own forward with each token's
latent entry (``[kv_lora_rank + rope]``, the normalised latent and the rotated shared key)
rounded as the cache stores it, one scale per token (tests/kv_quant_reference.py's
``round_latent_entries``); alone, batched, chunked, preempted, on prefix-cache hits, with
skipped layers and through the Triton kernels (interpreter). The cache holds codes and one
fp32 scale per token, more tokens in the same bytes; the pool stays clean."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.kv.kv_cache import KVCache, cache_layout
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts
from tests.engine.model.test_model_coverage import tiny_architecture
from tests.kv_quant_reference import round_latent_entries, round_trip

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts([3, 17, 40, 33], seed=5)
CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_architecture("deepseek_v3")


@pytest.fixture(scope="module", params=sorted(CODES))
def expected(request, model):
    """(kv-cache-dtype name, HF's greedy tokens over the rounded latent entries per prompt)."""
    reference = round_latent_entries(model, CODES[request.param])
    return request.param, [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


def run(engine: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert_pool_clean(engine.block_manager)
    return [got[f"r{i}"] for i in range(len(prompts))]


def engine_for(model: PreTrainedModel, name: str, **config: object) -> LLMEngine:
    settings = {"kv_cache_memory": 1 << 20, "kv_cache_dtype": name, **config}
    return LLMEngine(EngineConfig(**settings), loaded=loaded(copy.deepcopy(model)))


def test_the_reference_differs_from_the_unquantized_model(model, expected):
    """The data can fail: e4m3's rounding changes a greedy token of a prompt (int8 rounds too
    finely to flip this tiny model's tokens; the next test shows its reference moves)."""
    name, want = expected
    if name != "int8":
        assert [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS] != want


def test_the_reference_rounds_the_entries(model):
    """The reference's layers see rounded entries: the first greedy logits move (by about a
    quantization step, not by nothing)."""
    prompt = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        plain = model(prompt).logits
        rounded = round_latent_entries(model, torch.int8)(prompt).logits
    assert 0 < (plain - rounded).abs().max() < 0.1


def test_alone_and_batched(model, expected):
    """The engine starts with a quantized latent cache (it once refused one) and matches."""
    name, want = expected
    engine = engine_for(model, name)
    cache = engine.runner.kv_cache
    assert cache.layout.latent and cache.tensor.dtype == CODES[name]
    assert [run(engine, [p])[0] for p in PROMPTS] == want
    assert run(engine) == want


def test_chunked_and_preempted(model, expected):
    """8 tokens a step chunks every prompt; a pool of 4 blocks preempts."""
    name, want = expected
    layout = cache_layout(model.config)
    block = KVCache.bytes_per_block(num_layers=2, block_size=16, layout=layout, dtype=CODES[name])
    engine = engine_for(model, name, max_num_batched_tokens=8, kv_cache_memory=4 * block)
    assert run(engine) == want
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits(model, expected):
    """A second run of a prompt reads its first two blocks' codes and scales from the cache."""
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
    assert_pool_clean(engine.block_manager)


def test_triton_kernels(model, expected):
    name, want = expected
    engine = engine_for(model, name, attention_backend="triton", max_num_batched_tokens=24)
    assert run(engine, PROMPTS[:2]) == want[:2]


def test_the_cache_holds_codes_and_one_scale_per_token(model):
    """After a prompt, layer 1 holds each token's entry as int8 codes whose largest magnitude
    is 127 and one fp32 scale, and codes times scale is HF's entry (read from its ``expand_kv``
    inputs in the reference, whose layer 0 reads rounded entries as the engine's does) rounded
    as the reference rounds it, give or take one code step (the engine's projections sum in
    other orders, ~1e-6, which can move a value across a rounding boundary)."""
    prompt = PROMPTS[1]
    captured: list[torch.Tensor] = []
    hf = round_latent_entries(model, torch.int8)
    attn = hf.model.layers[1].self_attn

    def record(latent, k_rope, original=attn.expand_kv):
        captured.append(torch.cat((latent[0, 0], k_rope[0, 0]), dim=-1))
        return original(latent, k_rope)

    attn.expand_kv = record
    with torch.inference_mode():
        hf(torch.tensor([prompt]))
    engine = engine_for(model, "int8")
    request_id = engine.add_request(prompt, GREEDY)
    engine.step()  # the prefill
    cache = engine.runner.kv_cache
    codes, scales = cache.latent(1), cache.latent_scales(1)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == codes.shape[:2]
    table = torch.tensor(engine.block_manager.block_table(request_id))
    codes = codes[table].flatten(0, 1)[: len(prompt)]
    scales = scales[table].flatten(0, 1)[: len(prompt)]
    assert codes.abs().amax(-1).eq(127).all()
    entries = codes.float() * scales[:, None]
    want = round_trip(captured[0], torch.int8)
    assert ((entries - want).abs() <= 1.01 * scales[:, None]).all()
    torch.testing.assert_close(entries, want, atol=0.02, rtol=0)
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)


def test_skipped_layers_keep_the_model_dtype(model):
    """--kv-cache-dtype-skip-layers 0: layer 0 caches fp32 entries, layer 1 codes and scales;
    the tokens are HF's with only layer 1's entries rounded; a fork's block copies carry all
    three tensors."""
    want = [
        hf_greedy(round_latent_entries(model, torch.int8, skip=(0,)), p, MAX_TOKENS)
        for p in PROMPTS
    ]
    engine = engine_for(model, "int8", kv_cache_dtype_skip_layers=(0,))
    cache = engine.runner.kv_cache
    assert cache.latent(0).dtype == torch.float32 and cache.latent_scales(0) is None
    assert cache.latent(1).dtype == torch.int8 and cache.latent_scales(1) is not None
    assert len(cache.block_tensors()) == 3
    assert run(engine) == want
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2)
    engine.add_request(PROMPTS[1], params, request_id="fork")
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)


def test_the_cache_holds_more_tokens_in_the_same_bytes(model):
    """An entry of 32 + 16 lanes: 48 code bytes and a 4-byte scale a token and layer, against
    fp32's 192 bytes."""
    plain = engine_for(model, "auto").runner.kv_cache
    codes = engine_for(model, "int8").runner.kv_cache
    assert codes.scales is not None and codes.scales.shape[1] == 1  # one side, one "head"
    assert codes.num_tokens // plain.num_tokens == 3  # 192 / 52 = 3.7
    assert codes.num_bytes <= 1 << 20
    with pytest.raises(RuntimeError, match="use latent_scales"):
        codes.layer_scales(1)
