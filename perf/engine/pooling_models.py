"""Random-weight pooling checkpoints at the sizes people run on a CPU, for
``perf/engine/bench_pooling.py``: written to a folder with a word-level tokenizer (word ``wI``
is token ``I + 5``, so a text of N words is N tokens plus the model's specials) and a
sentence-transformers folder, so sentence-transformers itself loads and runs them.

    minilm      BertModel, all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads), mean pooling
    qwen3       Qwen3ForCausalLM, a small Qwen3-Embedding (8 layers, 512 wide, 8/4 heads of 64),
                last-token pooling
    reranker    the same Qwen3, scored from its "no"/"yes" logits (Qwen3-Reranker)
    cross       BertForSequenceClassification with one label, ms-marco-MiniLM-L6's shape
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>"]
VOCAB = 30522
WORDS = SPECIALS + ["no", "yes"] + [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 2)]
RERANKER_OVERRIDES = {"classifier_from_token": ["no", "yes"]}


def word_tokenizer(encoder: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        eos_token="<eos>",
        model_max_length=512 if encoder else 4096,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"]
        if encoder
        else ["input_ids", "attention_mask"],
    )


def _st_folder(folder: Path, width: int, pooling: str, max_seq_length: int) -> None:
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pool = {"word_embedding_dimension": width, f"pooling_mode_{pooling}": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    bert = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (folder / "sentence_bert_config.json").write_text(json.dumps(bert))


def _minilm_config(**extra: object) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=12,
        max_position_embeddings=512,
        **extra,
    )


def _qwen3_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=4,
    )


def build(kind: str, folder: Path) -> Path:
    """Write model ``kind`` (module docstring) to ``folder`` and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    encoder = kind in ("minilm", "cross")
    if kind == "minilm":
        BertModel(_minilm_config(), add_pooling_layer=False).save_pretrained(folder)
        _st_folder(folder, 384, "mean_tokens", 512)
    elif kind == "qwen3":
        Qwen3ForCausalLM(_qwen3_config()).save_pretrained(folder)
        _st_folder(folder, 512, "lasttoken", 4096)
    elif kind == "reranker":
        Qwen3ForCausalLM(_qwen3_config()).save_pretrained(folder)
    elif kind == "cross":
        BertForSequenceClassification(_minilm_config(num_labels=1)).save_pretrained(folder)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    word_tokenizer(encoder).save_pretrained(folder)
    return folder
