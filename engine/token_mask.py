"""Per-step grammar masks: each constrained row's allowed tokens as a packed int32 bitmask.

Row ``i`` of the mask is ``int32 [ceil(V / 32)]``: token ``t`` is allowed when bit ``t % 32`` of
word ``t // 32`` is set. Unconstrained rows in a mixed batch are all ones; a batch with no
constrained row gets no mask at all, so it pays nothing.

``grammar_allows_only`` answers, for ``min_tokens`` (engine/logit_adjustments.py), whether a
grammar leaves nothing but the tokens that rule would hold back.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def grammar_allows_only(
    matcher: object, tokens: Sequence[int], vocab_size: int, *, must_check: bool
) -> bool:
    """Whether the grammar ``matcher`` allows no next token but ``tokens``.

    A grammar allows its stop tokens only once it is complete, so while it is not (and
    ``must_check`` is False: ``tokens`` are only stop tokens) the answer is no without filling
    a mask; else one mask row is filled, the same the step's mask holds for this sequence.
    """
    if not must_check and not matcher.is_completed():
        return False
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    allowed = bits.flatten()[:vocab_size].bool()
    held = torch.tensor([t for t in tokens if 0 <= t < vocab_size], dtype=torch.long)
    allowed[held] = False
    return not bool(allowed.any())
