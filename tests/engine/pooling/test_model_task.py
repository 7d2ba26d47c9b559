"""What a checkpoint is served for (engine/model/model_task.py), the sentence-transformers
folders the engine refuses to half-read, and pooling under tensor parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, Qwen3Config

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.model_task import ModelTask, resolve_task
from paged_serve.engine.pooling.sentence_transformers import read_sentence_transformers
from paged_serve.engine.pooling_params import PoolingParams
from tests.engine.pooling.test_pooling_models import ENGINE, PAIRS, TEXTS, close
from tests.pooling_models import (
    bert_cross_encoder,
    bert_embedder,
    modernbert_embedder,
    qwen3_embedder,
    xlm_roberta_embedder,
)


def _config(config_class: type, architecture: str, **extra: object) -> object:
    return config_class(architectures=[architecture], **extra)


@pytest.mark.parametrize(
    ("architecture", "declared", "extra", "flags", "task"),
    [
        ("Qwen3ForCausalLM", False, {}, {}, ModelTask("generate")),
        ("Qwen3ForCausalLM", True, {}, {}, ModelTask("pooling", "embed")),
        ("Qwen3ForCausalLM", False, {}, {"runner": "pooling"}, ModelTask("pooling", "embed")),
        ("Qwen3ForCausalLM", False, {}, {"convert": "embed"}, ModelTask("pooling", "embed")),
        (
            "Qwen3ForCausalLM",
            False,
            {"classifier_from_token": ["no", "yes"]},
            {},
            ModelTask("pooling", "classify"),
        ),
        ("Qwen3ForSequenceClassification", False, {}, {}, ModelTask("pooling", "classify")),
        ("BertModel", False, {}, {}, ModelTask("pooling", "embed")),
    ],
)
def test_the_task_is_read_from_the_checkpoint(
    architecture: str, declared: bool, extra: dict, flags: dict, task: ModelTask, tmp_path: Path
) -> None:
    config_class = BertConfig if architecture.startswith("Bert") else Qwen3Config
    if declared:
        (tmp_path / "modules.json").write_text("[]")
    assert (
        resolve_task(_config(config_class, architecture, **extra), str(tmp_path), **flags) == task
    )


@pytest.mark.parametrize(
    ("architecture", "flags", "message"),
    [
        (
            "BertModel",
            {"runner": "generate"},
            "does not generate text: serve it with --runner pooling",
        ),
        ("Qwen3ForCausalLM", {"convert": "classify"}, "has no classifier"),
        ("Qwen3ForCausalLM", {"runner": "generate", "convert": "embed"}, "--runner pooling only"),
        ("Qwen3ForCausalLM", {"runner": "serve"}, "--runner must be one of"),
    ],
)
def test_a_task_the_checkpoint_cannot_serve_is_refused(
    architecture: str, flags: dict, message: str, tmp_path: Path
) -> None:
    config_class = BertConfig if architecture.startswith("Bert") else Qwen3Config
    with pytest.raises(ValueError, match=message):
        resolve_task(_config(config_class, architecture), str(tmp_path), **flags)


@pytest.mark.parametrize(
    ("module", "pooling", "message"),
    [
        ("sentence_transformers.models.LayerNorm", {"pooling_mode": "mean"}, "LayerNorm module"),
        ("sentence_transformers.models.Normalize", {"pooling_mode": "weightedmean"}, "not served"),
        (
            "sentence_transformers.models.Normalize",
            {"pooling_mode": "mean", "include_prompt": False},
            "leaves the prompt out",
        ),
    ],
)
def test_a_sentence_transformers_module_not_served_is_refused(
    module: str, pooling: dict, message: str, tmp_path: Path
) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2", "type": module},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=message):
        read_sentence_transformers(tmp_path)


def test_tensor_parallel_embeddings_equal_one_rank(tmp_path: Path) -> None:
    folder = qwen3_embedder(tmp_path / "qwen3")
    one = torch.tensor(LLM(str(folder), **ENGINE).embed(TEXTS))
    with LLM(str(folder), **ENGINE, tensor_parallel_size=2) as two:
        close(torch.tensor(two.embed(TEXTS)), one)


@pytest.mark.parametrize("build", [bert_embedder, xlm_roberta_embedder])
def test_tensor_parallel_encoder_embeddings_equal_one_rank(build, tmp_path: Path) -> None:
    """Megatron's split of BERT's layers; XLM-RoBERTa's position offset on every rank."""
    folder = build(tmp_path / "encoder")
    one = torch.tensor(LLM(str(folder), **ENGINE).embed(TEXTS))
    with LLM(str(folder), **ENGINE, tensor_parallel_size=2) as two:
        close(torch.tensor(two.embed(TEXTS)), one)
        two.engine.block_manager.check_integrity()


def test_tensor_parallel_cross_encoder_carries_segment_ids(tmp_path: Path) -> None:
    folder = bert_cross_encoder(tmp_path / "ce")
    tok = AutoTokenizer.from_pretrained(folder)
    encoded = [tok(a, b) for a, b in PAIRS]
    prompts = [e["input_ids"] for e in encoded]
    params = [PoolingParams("classify", token_type_ids=tuple(e["token_type_ids"])) for e in encoded]
    one = torch.tensor(LLM(str(folder), **ENGINE).classify(prompts, params))
    with LLM(str(folder), **ENGINE, tensor_parallel_size=2) as two:
        close(torch.tensor(two.classify(prompts, params)), one)


def test_an_encoder_tensor_parallelism_cannot_split_is_refused(tmp_path: Path) -> None:
    folder = modernbert_embedder(tmp_path / "modernbert")
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=2)
