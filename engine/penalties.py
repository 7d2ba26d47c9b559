"""Repetition, frequency and presence penalties: the logits a penalised request samples from.

For a row whose prompt tokens are ``P`` and generated tokens so far are ``O`` (token ``j``
generated ``c[j]`` times), in this order (vLLM's):

1. ``repetition_penalty`` r: for every token in ``P`` or ``O``, a logit ``x > 0`` becomes
   ``x / r`` and ``x <= 0`` becomes ``x * r`` (Hugging Face's ``repetition_penalty``);
2. ``frequency_penalty`` f: ``x[j] -= f * c[j]``;
3. ``presence_penalty`` p: ``x[j] -= p`` for every ``j`` with ``c[j] > 0`` (OpenAI's rule).

Only rows with a penalty are touched; the sampler (greedy or not) then draws from the result.
The logprobs a request reports stay the model's own (before penalties), as vLLM's do by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_tensors import to_device
from engine.request import Request


def _counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[R, V]`` fp32 occurrence counts of each row's tokens (exact: integers in fp32).

    A ``scatter_add`` over rows padded to the longest list (padding adds 0 to token 0): unlike
    an accumulating ``index_put``, it never reads anything back to the host.
    """
    width = max(1, max((len(t) for t in token_lists), default=0))
    ids = [list(t) + [0] * (width - len(t)) for t in token_lists]
    weights = [[1.0] * len(t) + [0.0] * (width - len(t)) for t in token_lists]
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    return counts.scatter_add_(
        1, to_device(ids, torch.long, device), to_device(weights, torch.float32, device)
    )


def penalize(
    logits: torch.Tensor,
    *,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> torch.Tensor:
    """The penalised copy of ``logits`` ``[R, V]`` fp32 (one row per entry of each list)."""
    vocab_size = logits.shape[1]
    device = logits.device
    out_counts = _counts(output_ids, vocab_size, device)
    seen = (_counts(prompt_ids, vocab_size, device) + out_counts) > 0
    column = to_device(list(repetition), logits.dtype, device)[:, None]
    factor = torch.where(seen, column, torch.ones_like(logits))
    penalised = torch.where(logits > 0, logits / factor, logits * factor)
    penalised -= to_device(list(frequency), logits.dtype, device)[:, None] * out_counts
    penalised -= to_device(list(presence), logits.dtype, device)[:, None] * (out_counts > 0)
    return penalised


def apply_penalties(logits: torch.Tensor, rows: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[len(rows), V]`` with each row's penalties applied; the same tensor when no
    row has any (the common case costs nothing)."""
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalised:
        return logits
    chosen = [rows[i] for i in penalised]
    index = to_device(penalised, torch.long, logits.device)
    return logits.index_copy(
        0,
        index,
        penalize(
            logits.index_select(0, index),
            prompt_ids=[r.prompt_token_ids for r in chosen],
            output_ids=[r.output_token_ids for r in chosen],
            repetition=[r.params.repetition_penalty for r in chosen],
            frequency=[r.params.frequency_penalty for r in chosen],
            presence=[r.params.presence_penalty for r in chosen],
        ),
    )
