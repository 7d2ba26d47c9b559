"""The classifier of a pooling model: its pooled row ``[B, H]`` to label logits ``[B, L]``.

Each family's own modules, called as its ``*ForSequenceClassification.forward`` calls them:

    decoders (Qwen3, Llama, ...)  ``score`` on the last token
    BERT                          the encoder's ``pooler`` (dense + tanh of the CLS row), then
                                  ``classifier``
    RoBERTa, XLM-RoBERTa          ``classifier`` (dense, tanh, ``out_proj``) on the CLS row
    ModernBERT                    ``head`` then ``classifier``, on the CLS row or the mean
                                  (``classifier_pooling``)

A causal LM converted with vLLM's ``classifier_from_token`` scores from its LM head's rows of
those tokens: one token gives its logit; two, ``[no, yes]`` as Qwen3-Reranker asks, give
``logit(yes) - logit(no)``, whose sigmoid is the softmax's ``p(yes)`` over the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

Classifier = Callable[[torch.Tensor], torch.Tensor]


def sequence_classifier(model: PreTrainedModel) -> tuple[Classifier, str]:
    """``(classifier, pooling mode)`` of a ``*ForSequenceClassification`` model."""
    name = type(model).__name__
    if isinstance(getattr(model, "score", None), nn.Linear):
        return model.score, "last"
    classifier = getattr(model, "classifier", None)
    if classifier is None:
        raise ValueError(f"{name}: no classifier module (score or classifier) found")
    head = getattr(model, "head", None)
    if head is not None:  # ModernBERT: prediction head, dropout, classifier
        mode = getattr(model.config, "classifier_pooling", "cls")
        return lambda rows: classifier(head(rows)), "mean" if mode == "mean" else "cls"
    pooler = getattr(model.base_model, "pooler", None)
    if pooler is not None:  # BERT: the pooler reads the first row of [B, L, H]
        return lambda rows: classifier(pooler(rows[:, None])), "cls"
    if hasattr(classifier, "out_proj"):  # RoBERTa's head reads features[:, 0]
        return lambda rows: classifier(rows[:, None]), "cls"
    raise ValueError(f"{name}: its classifier is not one paged-serve knows how to call")


def token_classifier(model: PreTrainedModel, tokenizer: object, tokens: list[str]) -> Classifier:
    """vLLM's ``classifier_from_token``: the LM head's rows of ``tokens`` (one or two of
    them, each one token of the vocabulary) as a one-label classifier."""
    if not 1 <= len(tokens) <= 2:
        raise ValueError(f"classifier_from_token takes one or two tokens, got {tokens}")
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer")
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"classifier_from_token: {token!r} is {len(encoded)} tokens, not one")
        ids.append(encoded[0])
    head = model.get_output_embeddings()
    weight = head.weight[ids].detach()  # [1 or 2, H]
    bias = None if head.bias is None else head.bias[ids].detach()
    if len(ids) == 2:
        weight = (weight[1] - weight[0])[None]
        bias = None if bias is None else (bias[1] - bias[0])[None]
    linear = nn.Linear(weight.shape[1], 1, bias=bias is not None)
    linear.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def label_names(model: PreTrainedModel, num_labels: int) -> tuple[str, ...]:
    """The labels by index, from the config's ``id2label`` (``LABEL_i`` where it has none)."""
    id2label = getattr(model.config, "id2label", None) or {}
    return tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels))
