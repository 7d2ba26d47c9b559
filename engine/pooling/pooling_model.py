"""What a pooling model pools and how its pooled row becomes the answer, built once at load.

::

    hidden states [T, H] --pooler (cls | mean | last | max)--> pooled [B, H]
        embed:    Dense layers (sentence-transformers) -> first ``dimensions`` lanes -> L2 norm
        classify: the family's classifier (engine/pooling/heads.py) -> softmax / sigmoid

The pooling mode comes from the sentence-transformers folder when there is one; else CLS for
a bidirectional encoder and the last token for a decoder (vLLM's defaults). A decoder whose
pooling reads only the last token can take prefix-cache hits (a hit skips tokens whose hidden
states no one reads); mean, CLS and max poolings compute every prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.model.architecture import is_bidirectional
from paged_serve.engine.model.model_task import position_offset
from paged_serve.engine.pooling.heads import (
    Classifier,
    label_names,
    sequence_classifier,
    token_classifier,
)
from paged_serve.engine.pooling.sentence_transformers import read_sentence_transformers
from paged_serve.engine.pooling_params import PoolingParams


@dataclass(frozen=True)
class PoolingModel:
    """A loaded pooling model's pipeline.

    task: ``embed`` or ``classify``; pooling: ``cls``, ``mean``, ``last`` or ``max``;
    causal: the model attends causally (a decoder: chunked prefill and, for ``last`` pooling,
    prefix-cache hits) or bidirectionally (an encoder: one pass over the whole prompt);
    size: the embedding's lanes or the number of labels; matryoshka: ``dimensions`` may be
    asked (``is_matryoshka`` or ``matryoshka_dimensions`` in the config, vLLM's fields), and
    ``matryoshka_dimensions`` the sizes allowed (empty: any up to ``size``);
    position_offset: added to each token's position in the model's input (RoBERTa's
    embeddings count positions from ``pad_token_id + 1``); token_types: the model reads
    segment ids (``type_vocab_size > 1``); prompts: the sentence-transformers prompts by name;
    max_seq_length: the sentence-transformers cut (tokens), if any.
    """

    task: str
    pooling: str
    causal: bool
    size: int
    normalize: bool = True
    dense: tuple[nn.Module, ...] = ()
    classifier: Classifier | None = None
    labels: tuple[str, ...] = ()
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    position_offset: int = 0
    token_types: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None

    @property
    def reads_every_token(self) -> bool:
        """Every prompt token's hidden state is pooled (no prefix-cache hit may skip one)."""
        return self.pooling != "last"

    def limits(self, max_model_len: int, budget: int) -> tuple[int, int]:
        """``(context, step budget)`` in tokens for an engine of ``max_model_len`` and
        ``budget``: the context cut to the sentence-transformers ``max_seq_length``, and an
        encoder's budget raised to hold a whole prompt (it is never chunked)."""
        if self.max_seq_length:
            max_model_len = min(max_model_len, self.max_seq_length)
        return max_model_len, budget if self.causal else max(budget, max_model_len)

    def describe(self) -> str:
        """One line for the start-up log."""
        unit = "lanes" if self.task == "embed" else "labels"
        kind = "decoder" if self.causal else "bidirectional encoder"
        return f"pooling model ({kind}): {self.task}, {self.pooling} pooling, {self.size} {unit}"

    def check(self, params: PoolingParams) -> None:
        """ValueError when ``params`` asks what this model cannot answer."""
        if params.task != self.task:
            raise ValueError(f"this model serves {self.task}, not {params.task}")
        if params.dimensions is not None:
            if not self.matryoshka:
                raise ValueError(
                    "dimensions: this model is not a Matryoshka model (its config sets neither "
                    "is_matryoshka nor matryoshka_dimensions)"
                )
            allowed = self.matryoshka_dimensions
            if params.dimensions > self.size or (allowed and params.dimensions not in allowed):
                shown = list(allowed) if allowed else f"1 to {self.size}"
                raise ValueError(f"dimensions must be one of {shown}, got {params.dimensions}")

    def finish(self, pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """The answers of pooled rows ``[B, H]``, one per row's ``params``: an embedding
        ``[d]`` or label scores ``[L]``, in float32."""
        if self.task == "classify":
            logits = self.classifier(pooled).float()
            return [_activated(row, p.activation) for row, p in zip(logits, params)]
        for module in self.dense:
            pooled = module(pooled)
        pooled = pooled.float()
        out = []
        for row, p in zip(pooled, params):
            if p.dimensions is not None:
                row = row[: p.dimensions]
            if self.normalize if p.normalize is None else p.normalize:
                row = nn.functional.normalize(row, dim=-1)
            out.append(row)
        return out


def check_task(pooling: PoolingParams | None, model: PoolingModel | None) -> None:
    """InvalidRequestError for a pooling request (``pooling``) to a model that generates
    (``model`` None), or a generating one to a pooling model."""
    if (pooling is None) == (model is None):
        return
    raise InvalidRequestError(
        "this model generates text: serve an embedding or classification model with "
        "--runner pooling"
        if model is None
        else f"this model is served for {model.task} (--runner pooling): "
        "serve a text-generation model with --runner generate"
    )


def _activated(logits: torch.Tensor, activation: bool) -> torch.Tensor:
    if not activation:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def pooling_model(
    model: PreTrainedModel, tokenizer: object | None, folder: str, task: str
) -> PoolingModel:
    """The pipeline of ``model`` loaded from ``folder`` for ``task`` (module docstring)."""
    config = model.config
    causal = not is_bidirectional(model)
    st = read_sentence_transformers(folder)
    common = {
        "causal": causal,
        "position_offset": position_offset(model),
        "token_types": int(getattr(config, "type_vocab_size", 0) or 0) > 1,
        "prompts": st.prompts if st else {},
        "default_prompt_name": st.default_prompt_name if st else None,
        "max_seq_length": st.max_seq_length if st else None,
    }
    if task == "classify":
        from_token = getattr(config, "classifier_from_token", None)
        if from_token:
            tokens = list(from_token)
            classifier = token_classifier(model, tokenizer, tokens)
            return PoolingModel(
                "classify", "last", size=1, classifier=classifier, labels=(tokens[-1],), **common
            )
        classifier, mode = sequence_classifier(model)
        num_labels = int(config.num_labels)
        labels = label_names(model, num_labels)
        return PoolingModel(
            "classify", mode, size=num_labels, classifier=classifier, labels=labels, **common
        )
    mode = (st.pooling if st else None) or ("last" if causal else "cls")
    dense = st.dense if st else ()
    size = dense[-1][0].out_features if dense else int(config.hidden_size)
    dims = tuple(int(d) for d in getattr(config, "matryoshka_dimensions", None) or ())
    device, dtype = model.device, next(model.parameters()).dtype
    for module in dense:
        module.to(device=device, dtype=dtype)
    return PoolingModel(
        "embed",
        mode,
        size=size,
        normalize=st.normalize if st else True,
        dense=dense,
        matryoshka=bool(getattr(config, "is_matryoshka", False) or dims),
        matryoshka_dimensions=dims,
        **common,
    )
