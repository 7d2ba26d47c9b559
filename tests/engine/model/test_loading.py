"""Checkpoints as users have them: a sharded safetensors folder (``model-0000x-of-0000y`` with
its index), tied and untied embeddings, and a mixture-of-experts checkpoint whose experts
transformers stores per expert and fuses at load, and gpt-oss's MXFP4 experts. Each loads with
exactly the saved (or encoded) weights and serves HF's greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.loader import load_model, quantized_checkpoint_options
from paged_serve.engine.model.stored_quantization import stored_quantization
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts, tiny_model
from tests.engine.model.test_model_coverage import tiny_architecture

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


FP4_VALUES = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _mxfp4(out_features: int, in_features: int, experts: int, gen: torch.Generator):
    """Random MXFP4 weights ``[E, out, in]``: e2m1 values in blocks of 32 along ``in`` sharing
    a power-of-two scale; returns (the values, the checkpoint's ``_blocks`` and ``_scales``)."""
    idx = torch.randint(0, 16, (experts, out_features, in_features // 32, 32), generator=gen)
    scales = torch.randint(121, 126, idx.shape[:-1], generator=gen, dtype=torch.int32)
    values = FP4_VALUES[idx] * torch.exp2((scales - 127).float())[..., None]
    blocks = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return values.reshape(experts, out_features, in_features), blocks, scales.to(torch.uint8)


def save_mxfp4_gpt_oss(folder) -> torch.nn.Module:
    """A tiny gpt-oss saved in ``folder`` with its experts stored as MXFP4 (``*_blocks``,
    ``*_scales``, a ``quantization_config``); returns the model holding the encoded values."""
    model = tiny_architecture("gpt_oss")
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    experts = model.config.num_local_experts
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)  # [E, in, out]
            values, blocks, scales = _mxfp4(param.shape[2], param.shape[1], experts, gen)
            with torch.no_grad():
                param.copy_(values.transpose(1, 2))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del state[key]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return model


def test_stored_quantization_reads_the_file_and_transformers_configs() -> None:
    """The same ``quant_method`` from ``config.json``'s dict and from the object transformers
    builds of it; none for an unquantized checkpoint, empty for a config that names none."""
    from types import SimpleNamespace

    from transformers import Mxfp4Config

    def config(quant: object) -> SimpleNamespace:
        return SimpleNamespace(quantization_config=quant)

    assert stored_quantization(config({"quant_method": "gptq", "bits": 4})) == "gptq"
    assert stored_quantization(config(Mxfp4Config(dequantize=True))) == "mxfp4"
    assert stored_quantization(config({})) == ""
    assert stored_quantization(SimpleNamespace()) is None


def test_gpt_oss_mxfp4_experts_are_dequantised_at_load(tmp_path) -> None:
    """A gpt-oss checkpoint whose experts are stored as MXFP4 loads with exactly the values those
    blocks encode and serves the tokens HF computes from them."""
    model = save_mxfp4_gpt_oss(tmp_path)
    # dequantised even where transformers would keep MXFP4 (a GPU with its kernels installed)
    assert quantized_checkpoint_options(str(tmp_path))["quantization_config"].dequantize
    loaded = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    for ours, theirs in zip(loaded.model.model.layers, model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(ours.mlp.experts, name), getattr(theirs.mlp.experts, name))
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory=2 << 20)
    prompts = random_prompts([5, 23], seed=9)
    got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, 8) for p in prompts]
    assert_pool_clean(llm.engine.block_manager)
