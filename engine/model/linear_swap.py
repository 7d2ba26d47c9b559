"""One walk for every projection swap (int8, int4, the CPU kernels): the decoder layers'
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


def swap_linears(model: nn.Module, make: LinearFactory) -> int:
    """In place, every plain ``nn.Linear`` under ``model.model.layers`` and the LM head (if it
    is one) for ``make(linear)`` where that is not None; returns how many were swapped. A
    swapped LM head is no longer tied to the embeddings unless ``make`` keeps the Parameter."""
    count = _swap_children(model.model.layers, make)
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and (replacement := make(head)) is not None:
        model.lm_head = replacement
        count += 1
    return count
