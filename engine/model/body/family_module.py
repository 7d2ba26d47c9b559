"""A block the family defines, run through its own module as HF's decoder layer calls it."""

from __future__ import annotations

import torch
from torch import nn


def family_forward(module: nn.Module, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``module``'s forward over ``x [T, hidden]`` as the one sequence ``[1, T, hidden]`` HF's
    layer passes, with ``kwargs``; its output ``[T, hidden]`` (the first of a tuple: an
    attention's weights, a mixture of experts' router scores)."""
    out = module(hidden_states=x[None], **kwargs)
    return (out[0] if isinstance(out, tuple) else out)[0]
