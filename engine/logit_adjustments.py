"""What a request changes in its logits before sampling: logit bias, then penalties.

For a row whose prompt tokens are ``P`` and generated tokens so far are ``O`` (token ``j``
generated ``c[j]`` times), in this order (vLLM's):

1. ``logit_bias`` b: ``x[j] += b[j]`` for each token the request biases (OpenAI's rule);
2. ``repetition_penalty`` r: for every token in ``P`` or ``O``, a logit ``x > 0`` becomes
   ``x / r`` and ``x <= 0`` becomes ``x * r`` (Hugging Face's ``repetition_penalty``);
3. ``frequency_penalty`` f: ``x[j] -= f * c[j]``;
4. ``presence_penalty`` p: ``x[j] -= p`` for every ``j`` with ``c[j] > 0`` (OpenAI's rule).

Only rows that ask for one of these are touched; the sampler (greedy or not) then draws from
the result. The logprobs a request reports stay the model's own, as vLLM's do by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.host_tensors import to_device
from engine.request import Request


def _scatter_rows(
    token_lists: Sequence[Sequence[int]],
    value_lists: Sequence[Sequence[float]],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """``[R, V]`` fp32: row ``i`` holds the sum of ``value_lists[i]`` at ``token_lists[i]``.

    A ``scatter_add`` over rows padded to the longest list (padding adds 0 to token 0): unlike
    an accumulating ``index_put``, it never reads anything back to the host.
    """
    width = max(1, max((len(t) for t in token_lists), default=0))
    ids = [list(t) + [0] * (width - len(t)) for t in token_lists]
    values = [list(v) + [0.0] * (width - len(v)) for v in value_lists]
    out = torch.zeros(len(token_lists), vocab_size, device=device)
    return out.scatter_add_(
        1, to_device(ids, torch.long, device), to_device(values, torch.float32, device)
    )


def _counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[R, V]`` fp32 occurrence counts of each row's tokens (exact: integers in fp32)."""
    return _scatter_rows(token_lists, [[1.0] * len(t) for t in token_lists], vocab_size, device)


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


RowsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]  # (selected rows, their indices)


def _rows(logits: torch.Tensor, wanted: list[int], fn: RowsFn) -> torch.Tensor:
    """``logits`` with rows ``wanted`` replaced by ``fn(those rows, their indices)``."""
    index = to_device(wanted, torch.long, logits.device)
    return logits.index_copy(0, index, fn(logits.index_select(0, index), wanted))


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[len(rows), V]`` plus each row's ``logit_bias``; the same tensor when no
    row has one."""
    wanted = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not wanted:
        return logits

    def add_bias(selected: torch.Tensor, indices: list[int]) -> torch.Tensor:
        pairs = [rows[i].params.logit_bias for i in indices]
        bias = _scatter_rows(
            [[t for t, _ in p] for p in pairs],
            [[b for _, b in p] for p in pairs],
            selected.shape[1],
            selected.device,
        )
        return selected + bias

    return _rows(logits, wanted, add_bias)


def apply_penalties(logits: torch.Tensor, rows: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[len(rows), V]`` with each row's penalties applied; the same tensor when no
    row has any (the common case costs nothing)."""
    wanted = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not wanted:
        return logits

    def penalise(selected: torch.Tensor, indices: list[int]) -> torch.Tensor:
        chosen = [rows[i] for i in indices]
        return penalize(
            selected,
            prompt_ids=[r.prompt_token_ids for r in chosen],
            output_ids=[r.output_token_ids for r in chosen],
            repetition=[r.params.repetition_penalty for r in chosen],
            frequency=[r.params.frequency_penalty for r in chosen],
            presence=[r.params.presence_penalty for r in chosen],
        )

    return _rows(logits, wanted, penalise)


def adjust_logits(logits: torch.Tensor, rows: Sequence[Request]) -> torch.Tensor:
    """Logit bias, then penalties; ``logits`` itself when no row asks for either."""
    return apply_penalties(apply_logit_bias(logits, rows), rows)
