"""Per-step grammar masks: each constrained row's allowed tokens as a packed int32 bitmask.

Row ``i`` of the mask is ``int32 [ceil(V / 32)]``: token ``t`` is allowed when bit ``t % 32`` of
word ``t // 32`` is set. Unconstrained rows in a mixed batch are all ones; a batch with no
constrained row gets no mask at all, so it pays nothing.
"""

from __future__ import annotations

import torch

from engine.request import Request


def bitmask_words(vocab_size: int) -> int:
    """int32 words per mask row."""
    return (vocab_size + 31) // 32


def fill_token_bitmask(rows: list[Request], vocab_size: int) -> torch.Tensor | None:
    """The step's mask ``int32 [len(rows), ceil(V / 32)]`` on the host, or None when no row has
    a grammar matcher."""
    constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return None
    mask = torch.full((len(rows), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i in constrained:
        rows[i].matcher.fill_next_token_bitmask(mask, i)
    return mask
