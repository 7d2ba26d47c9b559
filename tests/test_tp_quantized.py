"""Weight-only int8 under tensor parallelism: every rank quantizes its own shards after
sharding, and a TP=2 int8 engine's greedy tokens equal Hugging Face on the weights it multiplies
by. (Its own module: the TP engines of tests/test_tensor_parallel.py hold the process group
until that module ends.)"""

from __future__ import annotations

import copy

import torch

from engine import LLM, SamplingParams
from engine.fused_projections import fuse_projections
from engine.int8_weights import Int8Linear
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _int8_twin_at_tp2(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the weights a TP=2 int8 engine multiplies by, dequantized: one scale per
    output row, taken over each rank's shard (a row-parallel rank holds half of each row)."""
    twin = copy.deepcopy(model)
    fuse_projections(twin)
    with torch.no_grad():
        for name, module in list(twin.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            weight = module.weight
            shards = weight.chunk(2, dim=1) if name.endswith(("o_proj", "down_proj")) else [weight]
            parts = []
            for shard in shards:
                linear = torch.nn.Linear(shard.shape[1], shard.shape[0], bias=False)
                linear.weight.copy_(shard)
                parts.append(Int8Linear(linear).dequantized())
            module.weight.copy_(torch.cat(parts, dim=1))
    return twin


def test_int8_at_tp2_quantizes_every_rank_shard_and_equals_hf_on_those_weights():
    """Each rank quantizes its own shards after sharding, the row-parallel ones included, so a
    row-parallel row gets one scale per rank's half (at least as fine as TP=1's one per row)."""
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 40], seed=3)
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, kv_cache_memory=2 << 20,
              quantization="int8")  # fmt: skip
    try:
        layer = tp2.engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj.proj, Int8Linear)
        assert isinstance(layer.self_attn.qkv_proj.proj, Int8Linear)
        twin = _int8_twin_at_tp2(model)
        got = [r.token_ids for r in tp2.generate(prompts, GREEDY)]
        assert got == [hf_greedy(twin, p, MAX_TOKENS) for p in prompts]
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()
