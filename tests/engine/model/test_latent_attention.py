"""Multi-head latent attention (engine/model/latent_attention.py) beyond the greedy scenarios of
tests/engine/model/test_model_coverage.py: what the cache holds, what the swap leaves of the module,
and the memory figure the latent layout buys."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.kv.kv_cache import KVCache, cache_layout, per_head_elements_per_token
from paged_serve.engine.model.latent_attention import absorb_latent_attention, is_latent_attention
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts
from tests.engine.model.test_model_coverage import tiny_architecture


def test_deepseek_v3_caches_its_latent_not_per_head_keys_and_values():
    """DeepSeek-V3's own shape (61 layers, 128 heads, a 512 + 64 latent entry): 70,272 bytes a
    token in bf16, against 4,997,120 for per-head keys (192 lanes) and values (128 lanes)."""
    config = DeepseekV3Config()  # its defaults are DeepSeek-V3's shape
    layout = cache_layout(config, tensor_parallel_size=8)  # replicated, whatever the ranks
    assert (layout.sides, layout.num_kv_heads, layout.head_dim) == (1, 1, 576)
    latent = KVCache.bytes_per_block(
        num_layers=config.num_hidden_layers, block_size=1, layout=layout, dtype=torch.bfloat16
    )
    per_head = config.num_hidden_layers * per_head_elements_per_token(config) * 2
    assert (latent, per_head) == (70_272, 4_997_120)


def test_the_cache_holds_each_tokens_latent_and_rotated_rope_key():
    """After a prompt, the cache's entries are HF's normalised latent and its rotated shared key
    (read from HF's own module with a forward hook on ``expand_kv``'s inputs)."""
    model = tiny_architecture("deepseek_v3")
    prompt = random_prompts([21], seed=5)[0]
    captured: list[torch.Tensor] = []
    attn = model.model.layers[1].self_attn
    original = attn.expand_kv

    def record(latent: torch.Tensor, k_rope: torch.Tensor):
        captured.append(torch.cat((latent[0, 0], k_rope[0, 0]), dim=-1))
        return original(latent, k_rope)

    attn.expand_kv = record
    with torch.inference_mode():
        model(torch.tensor([prompt]))
    attn.expand_kv = original
    llm = LLM(loaded=loaded(model), kv_cache_memory=1 << 20)
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()  # the prefill
    table = engine.block_manager.block_table(request_id)
    cache = engine.runner.kv_cache.latent(1)  # [num_blocks, block_size, R + rope]
    entries = cache[torch.tensor(table)].flatten(0, 1)[: len(prompt)]
    # the engine's projections sum in other orders than HF's (fp32: ~1e-6 on O(1) values)
    torch.testing.assert_close(entries, captured[0], atol=1e-5, rtol=1e-4)
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)


def test_the_swap_absorbs_kv_b_proj_and_is_idempotent():
    model = tiny_architecture("deepseek_v3")
    attn = model.model.layers[0].self_attn
    weight = attn.kv_b_proj.weight.detach().clone()  # [H * (nope + v), R]
    assert is_latent_attention(attn)
    absorb_latent_attention(attn)
    absorb_latent_attention(attn)
    heads, nope, v, rank = 4, 32, 24, 32
    assert attn.kv_b_proj is None
    assert attn.w_uk.shape == (heads, nope, rank) and attn.w_uv_t.shape == (heads, rank, v)
    per_head = weight.view(heads, nope + v, rank)
    assert torch.equal(attn.w_uk, per_head[:, :nope])
    assert torch.equal(attn.w_uv_t, per_head[:, nope:].transpose(1, 2))
    assert "w_uk" not in attn.state_dict()  # derived, never saved


def test_int8_weights_run_beside_the_latent_cache():
    """Weight-only int8 quantizes every projection but the absorbed (dropped) kv_b_proj; the
    first greedy token, whose margin on this model exceeds int8's error, is HF's."""
    model = tiny_architecture("deepseek_v3")
    prompts = random_prompts([6, 17], seed=3)
    llm = LLM(loaded=loaded(model), kv_cache_memory=1 << 20, quantization="int8")
    results = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [r.token_ids[0] for r in results] == [hf_greedy(model, p, 1)[0] for p in prompts]
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("layer", [0, 1])
def test_a_per_head_view_of_a_latent_cache_is_refused(layer: int):
    llm = LLM(loaded=loaded(tiny_architecture("deepseek_v3")), kv_cache_memory=1 << 20)
    with pytest.raises(RuntimeError, match="use latent"):
        llm.engine.runner.kv_cache.layer(layer)
