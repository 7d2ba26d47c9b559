"""Checkpoints as users have them: a sharded safetensors folder (``model-0000x-of-0000y`` with
its index), tied and untied embeddings, and a mixture-of-experts checkpoint whose experts
transformers stores per expert and fuses at load. Each loads with exactly the saved weights and
serves HF's greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_model
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts, tiny_model
from tests.test_model_coverage import tiny_architecture

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _saved(model, folder, **save) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder, **save)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "name,tied",
    [("llama", False), ("llama", True), ("qwen3_moe", False), ("gemma2", True)],
)
def test_a_sharded_folder_loads_the_saved_weights_and_serves_them(tmp_path, name, tied):
    model = tiny_architecture(name) if name in ("qwen3_moe", "gemma2") else tiny_model(name)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    saved = _saved(model, tmp_path, max_shard_size="150KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really in shards
    loaded = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    state = loaded.model.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    head = loaded.model.get_output_embeddings().weight
    embed = loaded.model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == tied
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=2 << 20)
    prompts = random_prompts([5, 23], seed=9)
    got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, 8) for p in prompts]
    assert_pool_clean(llm.engine.block_manager)
