"""A tensor-parallel rank reads its own shard from a safetensors folder
(engine/model/shard_loading.py): bit for bit what sharding the whole model gives, for every
family tensor parallelism serves, from sharded and single-file checkpoints, with tied and untied
heads, per-expert MoE checkpoints included; the whole model where the files cannot be read
name for name; and a TP=2 engine on a folder serves HF's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.shard_loading import checkpoint_files, load_shard
from paged_serve.engine.model.sharding import shard_model
from tests.conftest import assert_pool_clean, hf_greedy, random_prompts, tiny_model
from tests.engine.model.test_model_coverage import tiny_architecture

# every family tensor parallelism shards (olmo2, olmoe and phi3 are refused: a norm over all
# heads, a fused qkv projection), the MoE ones stored per expert as transformers saves them
FAMILIES = [
    "llama",
    "cohere",
    "deepseek_v3",
    "gemma2",
    "gemma3",
    "glm4_moe",
    "gpt_oss",
    "granite",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "smollm3",
]


def _model(family: str):
    return tiny_model("llama") if family == "llama" else tiny_architecture(family)


def _expected(
    folder: Path, rank: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of 2's state dict the old way: the whole model loaded, then sharded."""
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    shard_model(whole, rank=rank, world_size=2)
    return whole.state_dict()


def _assert_same(got: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    have = got.state_dict()
    assert set(have) == set(want)
    for name, tensor in want.items():
        assert have[name].dtype == tensor.dtype, name
        assert torch.equal(have[name], tensor), name
    assert not any(p.is_meta for p in got.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_what_sharding_the_whole_model_gives(family: str, tmp_path: Path):
    _model(family).save_pretrained(tmp_path, max_shard_size="40KB")  # several files
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for rank in (0, 1):
        got = load_shard(str(tmp_path), rank=rank, world_size=2, dtype=torch.float32)
        assert got is not None
        _assert_same(got, _expected(tmp_path, rank))


def test_a_tied_head_stays_tied_and_bf16_is_cast_at_load(tmp_path: Path):
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path)  # one file, no index
    got = load_shard(str(tmp_path), rank=1, world_size=2, dtype=torch.bfloat16)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    _assert_same(got, _expected(tmp_path, 1, torch.bfloat16))


def test_the_whole_model_where_the_files_do_not_name_every_parameter(tmp_path: Path):
    tiny_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")  # some other naming
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "model.norm.scale" in checkpoint_files(tmp_path)
    assert load_shard(str(tmp_path), rank=0, world_size=2, dtype=torch.float32) is None
    assert load_shard("org/not-on-disk", rank=0, world_size=2, dtype=torch.float32) is None


def test_a_quantized_checkpoint_other_than_mxfp4_is_loaded_whole(tmp_path: Path):
    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_shard(str(tmp_path), rank=0, world_size=2, dtype=torch.float32) is None


def test_mxfp4_experts_are_read_and_dequantised_per_rank(tmp_path: Path):
    """gpt-oss's MXFP4 experts: each rank reads its rows of ``gate_up_proj_blocks`` (output
    columns, interleaved gate/up pairs) and its groups of ``down_proj_blocks`` (input features),
    and dequantises them: equal to transformers' dequantisation of the whole model, sharded."""
    from paged_serve.engine.model.loader import load_model
    from tests.engine.model.test_loading import save_mxfp4_gpt_oss

    save_mxfp4_gpt_oss(tmp_path)
    for rank in (0, 1):
        got = load_shard(str(tmp_path), rank=rank, world_size=2, dtype=torch.float32)
        assert got is not None
        whole = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu")).model
        shard_model(whole, rank=rank, world_size=2)
        _assert_same(got, whole.state_dict())


def test_what_does_not_shard_is_refused_before_any_tensor_is_read(tmp_path: Path):
    model = tiny_architecture("olmo2")
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # reading would fail: it never happens
    names = [name for name, _ in model.named_parameters()]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")})
    )
    with pytest.raises(ValueError, match="q_norm normalises over all heads"):
        load_shard(str(tmp_path), rank=0, world_size=2, dtype=torch.float32)


@pytest.mark.parametrize("checkpoint", ["qwen3_moe", "gpt_oss_mxfp4"])
def test_a_tp2_engine_on_a_folder_loads_shards_and_equals_hf(checkpoint: str, tmp_path: Path):
    if checkpoint == "gpt_oss_mxfp4":
        from tests.engine.model.test_loading import save_mxfp4_gpt_oss

        model = save_mxfp4_gpt_oss(tmp_path)
    else:
        model = tiny_architecture(checkpoint)
        model.save_pretrained(tmp_path, max_shard_size="40KB")
    prompts = random_prompts([5, 17, 40], seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", kv_cache_memory=4 << 20)
    try:
        assert llm.engine.loaded.shard == (0, 2)  # rank 0 read its shard alone
        assert [r.token_ids for r in llm.generate(prompts, greedy)] == want
        assert_pool_clean(llm.engine.block_manager)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_each_tensor_goes_to_the_rank_device_as_it_is_read(family: str, tmp_path: Path):
    """With a device, every parameter and every buffer the checkpoint stores (DeepSeek's
    router bias) is put there as it is read, tied ones once: on a GPU the host never holds the
    shard. The meta device stands in for a GPU here; the shapes are the CPU shard's."""
    _model(family).save_pretrained(tmp_path, max_shard_size="40KB")
    meta = torch.device("meta")
    got = load_shard(str(tmp_path), rank=1, world_size=2, dtype=torch.float32, device=meta)
    want = load_shard(str(tmp_path), rank=1, world_size=2, dtype=torch.float32)
    stored = set(checkpoint_files(tmp_path))
    have = dict(got.named_parameters()) | dict(got.named_buffers())
    for name, tensor in dict(want.named_parameters()).items():
        assert have[name].is_meta and have[name].shape == tensor.shape, name
    buffers = [name for name, _ in want.named_buffers() if name in stored]
    assert buffers or family == "llama"
    for name in buffers:
        assert have[name].is_meta, name
