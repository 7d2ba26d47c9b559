"""Adapters the engine cannot serve are refused when loaded, naming why, and change nothing:
the served adapters, the slots and the pool are as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.lora.adapter_files import AdapterError
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import loaded, tiny_model
from tests.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(base):
    return LLMEngine(
        EngineConfig(kv_cache_memory=2 << 20, lora=LoRAConfig(max_loras=1, max_lora_rank=8)),
        loaded=loaded(base),
    )


def refused(engine: LLMEngine, path: Path, match: str) -> None:
    before = [a.name for a in engine.loras.served()]
    with pytest.raises(AdapterError, match=match):
        engine.loras.add(engine.loras.read("x", str(path)))
    assert [a.name for a in engine.loras.served()] == before


def test_rank_above_the_maximum(base, engine, tmp_path):
    make_adapter(base, tmp_path / "big", seed=0, rank=16)
    refused(engine, tmp_path / "big", "rank 16 is above --max-lora-rank 8")


def test_dora(base, engine, tmp_path):
    make_adapter(base, tmp_path / "dora", seed=0, rank=4, use_dora=True)
    refused(engine, tmp_path / "dora", "DoRA")


def test_modules_to_save(base, engine, tmp_path):
    make_adapter(base, tmp_path / "head", seed=0, rank=4, modules_to_save=["lm_head"])
    refused(engine, tmp_path / "head", "modules_to_save")


def test_lora_on_the_embeddings(base, engine, tmp_path):
    make_adapter(base, tmp_path / "embed", seed=0, rank=4, targets=["embed_tokens", "q_proj"])
    refused(engine, tmp_path / "embed", "embed_tokens.*LoRA on the embeddings")


def test_an_adapter_of_another_base(engine, tmp_path):
    """Same family, wider hidden state: the matrices do not fit the served projections."""
    other = tiny_model("llama")
    other.config.hidden_size = 128
    wider = type(other)(type(other.config)(**{**other.config.to_dict(), "hidden_size": 192}))
    make_adapter(wider, tmp_path / "other", seed=0, rank=4)
    refused(engine, tmp_path / "other", "another base model")


def test_missing_and_damaged_files(engine, tmp_path):
    refused(engine, tmp_path / "nowhere", "no adapter_config.json")
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{not json")
    refused(engine, folder, "not readable JSON")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    refused(engine, folder, "peft_type 'IA3'")
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    refused(engine, folder, "no adapter_model.safetensors")
    (folder / "adapter_model.safetensors").write_bytes(b"garbage")
    refused(engine, folder, "not a readable safetensors")
    a = torch.zeros(4, 128)
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a},
        str(folder / "adapter_model.safetensors"),
    )
    refused(engine, folder, "lora_A alone")


def test_mixture_of_experts_targets_are_named(engine, tmp_path):
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    key = "base_model.model.model.layers.0.mlp.experts.0.up_proj"
    save_file(
        {f"{key}.lora_A.weight": torch.zeros(4, 128), f"{key}.lora_B.weight": torch.zeros(8, 4)},
        str(folder / "adapter_model.safetensors"),
    )
    refused(engine, folder, "mixture of experts")


def test_names_are_unique_and_the_base_name_is_taken(base, engine, tmp_path):
    make_adapter(base, tmp_path / "ok", seed=0, rank=4)
    read = engine.loras.read("ok", str(tmp_path / "ok"))
    engine.loras.add(read, reserved=frozenset({"tiny"}))
    with pytest.raises(AdapterError, match="already served"):
        engine.loras.add(engine.loras.read("ok", str(tmp_path / "ok")))
    with pytest.raises(AdapterError, match="already served"):
        engine.loras.add(engine.loras.read("tiny", str(tmp_path / "ok")), reserved={"tiny"})
    engine.loras.remove("ok")


def test_unknown_adapter_and_lora_off(base, engine):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'nope'"):
        engine.add_request([1, 2, 3], params, lora="nope")
    plain = LLMEngine(EngineConfig(kv_cache_memory=1 << 20), loaded=loaded(base))
    with pytest.raises(InvalidRequestError, match="--enable-lora is off"):
        plain.add_request([1, 2, 3], params, lora="any")
    assert not engine.has_unfinished and not plain.has_unfinished


def test_lora_modules_refused_at_start(base, tmp_path):
    make_adapter(base, tmp_path / "big", seed=0, rank=16)
    lora = LoRAConfig(max_lora_rank=8, modules=(LoRAModule("big", str(tmp_path / "big")),))
    with pytest.raises(AdapterError, match="above --max-lora-rank"):
        LLMEngine(EngineConfig(kv_cache_memory=1 << 20, lora=lora), loaded=loaded(base))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": 0}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"modules": (LoRAModule("a", "x"), LoRAModule("a", "y"))}, "twice"),
    ],
)
def test_config_checks(fields, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**fields)
