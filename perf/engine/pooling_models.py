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
from safetensors.torch import save_file
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


def word_tokenizer(
    words: list[str], encoder: bool, max_length: int = 512
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` (token ``i`` is ``words[i]``; they hold
    ``[PAD] [UNK] [CLS] [SEP] <eos>``). An encoder's wraps inputs as BERT does (``[CLS] a
    [SEP]``, pairs ``[CLS] a [SEP] b [SEP]`` with segment ids 0 then 1, which it returns); a
    decoder's adds nothing."""
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = ["input_ids", "attention_mask"]
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        names = ["input_ids", "token_type_ids", "attention_mask"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        eos_token="<eos>",
        mask_token="[MASK]" if "[MASK]" in vocab else None,
        model_max_length=max_length,
        model_input_names=names,
    )


def sentence_transformers_folder(
    folder: Path,
    width: int,
    pooling: str,
    *,
    normalize: bool = True,
    dense: int | None = None,
    prompts: dict[str, str] | None = None,
    max_seq_length: int | None = None,
) -> None:
    """Write a sentence-transformers pipeline beside a transformer's files in ``folder``:
    ``pooling`` in sentence-transformers' old flag style (``mean_tokens``, ``cls_token``,
    ``lasttoken``, ``max_tokens``), an optional Dense layer to ``dense`` lanes (tanh), then
    Normalize, the ``prompts`` and a ``max_seq_length``."""
    kind = "sentence_transformers.models."
    modules = [{"idx": 0, "name": "0", "path": "", "type": kind + "Transformer"}]
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": width, f"pooling_mode_{pooling}": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": kind + "Pooling"})
    if dense is not None:
        path = folder / "2_Dense"
        path.mkdir(exist_ok=True)
        linear = torch.nn.Linear(width, dense)
        weights = {"linear.weight": linear.weight.detach(), "linear.bias": linear.bias.detach()}
        save_file(weights, str(path / "model.safetensors"))
        dense_config = {
            "in_features": width,
            "out_features": dense,
            "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh",
        }
        (path / "config.json").write_text(json.dumps(dense_config))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": kind + "Dense"})
    if normalize:
        (folder / "3_Normalize").mkdir(exist_ok=True)
        modules.append({"idx": 3, "name": "3", "path": "3_Normalize", "type": kind + "Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    st_config = {"prompts": prompts or {}, "default_prompt_name": None}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    if max_seq_length is not None:
        bert_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
        (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))


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
        sentence_transformers_folder(folder, 384, "mean_tokens", max_seq_length=512)
    elif kind == "qwen3":
        Qwen3ForCausalLM(_qwen3_config()).save_pretrained(folder)
        sentence_transformers_folder(folder, 512, "lasttoken", max_seq_length=4096)
    elif kind == "reranker":
        Qwen3ForCausalLM(_qwen3_config()).save_pretrained(folder)
    elif kind == "cross":
        BertForSequenceClassification(_minilm_config(num_labels=1)).save_pretrained(folder)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    word_tokenizer(WORDS, encoder, 512 if encoder else 4096).save_pretrained(folder)
    return folder
