"""One walk for every projection swap (int8, int4, the CPU kernels): the transformer layers'
``nn.Linear`` children and the LM head, each replaced by what a factory makes of it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# Given a plain nn.Linear, the module to put in its place, or None to keep it.
LinearFactory = Callable[[nn.Linear], "nn.Module | None"]


def _swap_children(module: nn.Module, make: LinearFactory) -> int:
    count = 0
    for name, child in module.named_children():
        if type(child) is not nn.Linear:
            count += _swap_children(child, make)
        elif (replacement := make(child)) is not None:
            setattr(module, name, replacement)
            count += 1
    return count


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer layers: a decoder's ``model.model.layers``, a
    vision-language model's language model's (``model.model.language_model.layers``), a BERT or
    RoBERTa encoder's ``encoder.layer``, ModernBERT's ``layers``."""
    decoder = getattr(model, "model", None)
    if isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        return decoder.layers
    language = getattr(decoder, "language_model", None)
    if isinstance(getattr(language, "layers", None), nn.ModuleList):
        return language.layers
    base = getattr(model, "base_model", model)
    for owner, name in ((getattr(base, "encoder", None), "layer"), (base, "layers")):
        if isinstance(getattr(owner, name, None), nn.ModuleList):
            return getattr(owner, name)
    raise ValueError(f"{type(model).__name__}: no list of transformer layers found")


def swap_linears(model: nn.Module, make: LinearFactory) -> int:
    """In place, every plain ``nn.Linear`` of the model's transformer layers
    (``transformer_layers``) and the LM head (if it is one) for ``make(linear)`` where that is
    not None; returns how many were swapped. A swapped LM head is no longer tied to the
    embeddings unless ``make`` keeps the Parameter."""
    count = _swap_children(transformer_layers(model), make)
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and (replacement := make(head)) is not None:
        model.lm_head = replacement
        count += 1
    return count
