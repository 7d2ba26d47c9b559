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
from itertools import chain

import torch

from engine.host_tensors import cpu_to_device, to_device
from engine.request import Request


def _flat_index(token_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """CPU int64 ``row * V + token`` for every token of every row, built in C loops."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    return rows * vocab_size + tokens


def penalize(
    logits: torch.Tensor,
    *,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> torch.Tensor:
    """The penalised copy of ``logits`` ``[R, V]`` fp32 (one row per entry of each list).

    Sparse: only the (row, token) entries a row has seen are read or written. Their indices
    are found on the host (``torch.unique`` over ``row * V + token``) and sent once, so the
    cost grows with the tokens, not with ``R * V``, and nothing is read back from the device.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    flat = logits.flatten().clone()
    outputs = _flat_index(output_ids, vocab_size)
    seen = torch.unique(torch.cat([_flat_index(prompt_ids, vocab_size), outputs]))
    if seen.numel():
        r = cpu_to_device(torch.tensor(repetition, dtype=torch.float32)[seen // vocab_size], device)
        index = cpu_to_device(seen, device)
        x = flat[index]
        flat[index] = torch.where(x > 0, x / r, x * r)
    out_index, counts = torch.unique(outputs, return_counts=True)
    if out_index.numel():
        rows = out_index // vocab_size
        frequency_t = torch.tensor(frequency, dtype=torch.float32)
        presence_t = torch.tensor(presence, dtype=torch.float32)
        delta = frequency_t[rows] * counts + presence_t[rows]
        flat.index_add_(0, cpu_to_device(out_index, device), cpu_to_device(-delta, device))
    return flat.view_as(logits)


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
        index = _flat_index([[t for t, _ in p] for p in pairs], selected.shape[1])
        bias = torch.tensor([b for p in pairs for _, b in p], dtype=torch.float32)
        flat = selected.flatten().index_add(
            0, cpu_to_device(index, selected.device), cpu_to_device(bias, selected.device)
        )
        return flat.view_as(selected)

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
