"""What a request changes in its logits before sampling: logit bias, then penalties.

For a row whose prompt tokens are ``P`` and generated tokens so far are ``O`` (token ``j``
generated ``c[j]`` times), in this order (vLLM's):

1. ``logit_bias`` b: ``x[j] += b[j]`` for each token the request biases (OpenAI's rule);
2. ``repetition_penalty`` r: for every token in ``P`` or ``O``, a logit ``x > 0`` becomes
   ``x / r`` and ``x <= 0`` becomes ``x * r`` (Hugging Face's ``repetition_penalty``);
3. ``frequency_penalty`` f: ``x[j] -= f * c[j]``;
4. ``presence_penalty`` p: ``x[j] -= p`` for every ``j`` with ``c[j] > 0`` (OpenAI's rule);
5. ``min_tokens`` m: while fewer than ``m`` tokens are generated, EOS and the request's
   ``stop_token_ids`` are set to -inf (vLLM's rule), so they cannot be drawn. Except where the
   row's grammar allows nothing else (``guided_choice: ["yes"]`` once ``yes`` is out): there
   the constraint wins and the request ends, short of ``m``, rather than draw from no token.

Only rows that ask for one of these are touched; the sampler (greedy or not) then draws from
the result. The logprobs a request reports stay the model's own, as vLLM's do by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from paged_serve.engine.platform.host_tensors import cpu_to_device, to_device
from paged_serve.engine.sample.token_mask import allows_only
from paged_serve.engine.sched.request import Request


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


def _add_bias(logits: torch.Tensor, pairs: Sequence[Sequence[tuple[int, float]]]) -> torch.Tensor:
    """``logits`` ``[R, V]`` plus row ``i``'s ``(token, bias)`` pairs ``pairs[i]``."""
    index = _flat_index([[t for t, _ in p] for p in pairs], logits.shape[1])
    bias = torch.tensor([b for p in pairs for _, b in p], dtype=torch.float32)
    flat = logits.flatten().index_add(
        0, cpu_to_device(index, logits.device), cpu_to_device(bias, logits.device)
    )
    return flat.view_as(logits)


def _too_early(request: Request) -> bool:
    return len(request.output_token_ids) < request.params.min_tokens


def _held_back(
    request: Request, eos_token_ids: Sequence[int], mask_row: torch.Tensor | None, vocab: int
) -> list[int]:
    """The tokens ``min_tokens`` holds back in this row now: EOS and the stop ids while the row
    is short of it, none when its grammar mask (``mask_row``, ``int32 [ceil(V / 32)]``) allows
    nothing else (the grammar must end here)."""
    if not _too_early(request):
        return []
    held = [*eos_token_ids, *request.params.stop_token_ids]
    if request.matcher is not None and mask_row is not None and allows_only(mask_row, held, vocab):
        return []
    return held


def adjust_logits(
    logits: torch.Tensor,
    rows: Sequence[Request],
    eos_token_ids: Sequence[int] = (),
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits`` ``[len(rows), V]`` with each row's logit bias, then penalties, then its
    ``min_tokens`` block of EOS and stop ids applied; ``logits`` itself when no row asks for
    any of them (the common case costs nothing).

    One gather and one scatter of the rows that ask; within them, a row that asks only for a
    bias contributes no tokens to the penalties, and the other way round. ``mask`` is the
    step's grammar mask ``int32 [len(rows), ceil(V / 32)]`` (engine/sample/token_mask.py), if any.
    """
    vocab_size = logits.shape[1]
    held = [
        _held_back(r, eos_token_ids, None if mask is None else mask[i], vocab_size)
        for i, r in enumerate(rows)
    ]
    wanted = [
        i for i, r in enumerate(rows) if r.params.logit_bias or r.params.has_penalties or held[i]
    ]
    if not wanted:
        return logits
    chosen = [rows[i].params for i in wanted]
    penalised = [p.has_penalties for p in chosen]
    index = to_device(wanted, torch.long, logits.device)
    selected = _add_bias(logits.index_select(0, index), [p.logit_bias for p in chosen])
    selected = penalize(
        selected,
        prompt_ids=[rows[i].prompt_token_ids if on else [] for i, on in zip(wanted, penalised)],
        output_ids=[rows[i].output_token_ids if on else [] for i, on in zip(wanted, penalised)],
        repetition=[p.repetition_penalty for p in chosen],
        frequency=[p.frequency_penalty for p in chosen],
        presence=[p.presence_penalty for p in chosen],
    )
    blocked = [held[i] for i in wanted]
    if any(blocked):
        flat = selected.flatten()
        flat[cpu_to_device(_flat_index(blocked, vocab_size), logits.device)] = float("-inf")
        selected = flat.view_as(selected)
    return logits.index_copy(0, index, selected)
