"""Tiny random-weight pooling checkpoints written to folders, as users ship them: a word-level
tokenizer (no download), the model's safetensors and, for embedders, a sentence-transformers
folder (the writers are perf/engine/pooling_models.py's, which builds the benchmark's real-sized
ones). Engine and server tests load them by path."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    Gemma3TextConfig,
    Gemma3TextModel,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
    NomicBertConfig,
    NomicBertModel,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

from perf.engine.pooling_models import sentence_transformers_folder, word_tokenizer

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>", "[MASK]"]
WORDS = SPECIALS + ["yes", "no", "query:", "document:"] + [f"w{i}" for i in range(118)]
PAD, CLS, SEP, EOS = 0, 2, 3, 4


def _save(model: PreTrainedModel, folder: Path, encoder: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    word_tokenizer(WORDS, encoder).save_pretrained(folder)
    return folder


def _qwen3_config(**extra: object) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        eos_token_id=EOS,
        **extra,
    )


def _bert_config(config_class: type = BertConfig, **extra: object) -> object:
    settings = {
        "vocab_size": len(WORDS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "pad_token_id": PAD,
        **extra,
    }
    return config_class(**settings)


def qwen3_embedder(folder: Path, pooling: str = "lasttoken", seed: int = 0, **st: object) -> Path:
    """A Qwen3 causal LM with a sentence-transformers folder (Qwen3-Embedding's shape)."""
    torch.manual_seed(seed)
    _save(Qwen3ForCausalLM(_qwen3_config()), folder, encoder=False)
    sentence_transformers_folder(folder, 64, pooling, **st)
    return folder


def bert_embedder(folder: Path, pooling: str = "mean_tokens", seed: int = 0, **st: object) -> Path:
    """A BertModel with a sentence-transformers folder (all-MiniLM's shape)."""
    torch.manual_seed(seed)
    _save(BertModel(_bert_config(), add_pooling_layer=False), folder, encoder=True)
    sentence_transformers_folder(folder, 64, pooling, **st)
    return folder


def xlm_roberta_embedder(folder: Path, pooling: str = "cls_token", seed: int = 0) -> Path:
    """An XLMRobertaModel with CLS pooling (bge-m3's shape)."""
    torch.manual_seed(seed)
    config = _bert_config(
        XLMRobertaConfig, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1
    )
    _save(XLMRobertaModel(config, add_pooling_layer=False), folder, encoder=True)
    sentence_transformers_folder(folder, 64, pooling)
    return folder


def modernbert_embedder(folder: Path, pooling: str = "mean_tokens", seed: int = 0) -> Path:
    """A ModernBertModel (global and local attention layers) with mean pooling."""
    torch.manual_seed(seed)
    config = _modernbert_config()
    _save(ModernBertModel(config), folder, encoder=True)
    sentence_transformers_folder(folder, 64, pooling)
    return folder


def nomic_bert_embedder(folder: Path, pooling: str = "mean_tokens", seed: int = 0) -> Path:
    """A NomicBertModel (rotary positions, SwiGLU) with mean pooling (nomic-embed's shape)."""
    torch.manual_seed(seed)
    config = _bert_config(NomicBertConfig, max_position_embeddings=256, type_vocab_size=2)
    _save(NomicBertModel(config), folder, encoder=True)
    sentence_transformers_folder(folder, 64, pooling)
    return folder


def embeddinggemma_embedder(folder: Path, seed: int = 0) -> Path:
    """A Gemma 3 text model with bidirectional attention (sliding and full layers), mean pooling
    and a Dense layer (EmbeddingGemma's shape)."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        use_bidirectional_attention=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=PAD,
        architectures=["Gemma3TextModel"],
    )
    _save(Gemma3TextModel(config), folder, encoder=False)
    sentence_transformers_folder(folder, 64, "mean_tokens", dense=48)
    return folder


def _modernbert_config(**extra: object) -> ModernBertConfig:
    return ModernBertConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        global_attn_every_n_layers=2,
        local_attention=8,
        pad_token_id=PAD,
        cls_token_id=CLS,
        sep_token_id=SEP,
        **extra,
    )


def modernbert_cross_encoder(folder: Path, pooling: str = "mean", seed: int = 0) -> Path:
    """A ModernBertForSequenceClassification with one label and ``classifier_pooling``."""
    torch.manual_seed(seed)
    config = _modernbert_config(num_labels=1, classifier_pooling=pooling)
    return _save(ModernBertForSequenceClassification(config), folder, encoder=True)


def bert_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """A BERT cross-encoder (one label, sentence-transformers' CrossEncoder shape): segment ids
    tell the query from the document."""
    torch.manual_seed(seed)
    config = _bert_config(num_labels=1, type_vocab_size=2)
    return _save(BertForSequenceClassification(config), folder, encoder=True)


def xlm_roberta_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """An XLM-RoBERTa cross-encoder (bge-reranker-v2-m3's shape)."""
    torch.manual_seed(seed)
    config = _bert_config(
        XLMRobertaConfig,
        num_labels=1,
        max_position_embeddings=130,
        pad_token_id=1,
        type_vocab_size=1,
    )
    return _save(XLMRobertaForSequenceClassification(config), folder, encoder=True)


def qwen3_classifier(folder: Path, num_labels: int = 3, seed: int = 0) -> Path:
    """A Qwen3ForSequenceClassification scoring the last token."""
    torch.manual_seed(seed)
    labels = {i: f"label_{i}" for i in range(num_labels)}
    config = _qwen3_config(num_labels=num_labels, id2label=labels)
    return _save(Qwen3ForSequenceClassification(config), folder, encoder=False)


def qwen3_reranker(folder: Path, seed: int = 0) -> Path:
    """A Qwen3 causal LM scored from its "yes"/"no" logits (Qwen3-Reranker's shape; served with
    vLLM's ``--hf-overrides '{"classifier_from_token": ["no", "yes"]}'``)."""
    torch.manual_seed(seed)
    return _save(Qwen3ForCausalLM(_qwen3_config()), folder, encoder=False)


RERANKER_OVERRIDES = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
