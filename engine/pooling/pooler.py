"""A step's hidden states to one pooled row per prompt, prompt chunk by prompt chunk.

A decoder's prompt may run over several steps (chunked prefill), so a pooling that reads every
token carries a running state from chunk to chunk on its request (``Request.pool_state``, a
device tensor: never read on the host until the prompt is done)::

    cls    the first chunk's first row
    mean   the running sum of the rows (fp32), divided by the prompt's length at the end
    max    the running lane-wise maximum
    last   the last chunk's last row (no state)

A chunk that starts at position 0 starts afresh (a preempted request recomputes its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.sched.batch import ScheduledBatch


@dataclass(frozen=True, slots=True)
class PooledChunk:
    """One pooling request's rows ``[first, last)`` of the step's flat batch, covering prompt
    positions ``[start, end)`` of a ``length``-token prompt; ``state`` its running pool."""

    request_id: str
    first: int
    last: int
    start: int
    end: int
    length: int
    params: PoolingParams
    state: object | None

    @property
    def completes(self) -> bool:
        return self.end == self.length


def pooled_chunks(batch: ScheduledBatch) -> list[PooledChunk]:
    """The step's pooling requests, in scheduled order with their flat rows."""
    chunks: list[PooledChunk] = []
    row = 0
    for sched in batch.requests:
        request = sched.request
        if request.pooling is not None:
            chunks.append(
                PooledChunk(
                    request.request_id,
                    row,
                    row + sched.num_new_tokens,
                    sched.start,
                    sched.end,
                    request.num_prompt_tokens,
                    request.pooling,
                    request.pool_state if sched.start > 0 else None,
                )
            )
        row += sched.num_new_tokens
    return chunks


def pool_chunks(
    hidden: torch.Tensor, chunks: list[PooledChunk], mode: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(pooled, states)``: the pooled row ``[H]`` of each request whose prompt this step
    completes, and the running state of each that goes on; ``hidden [T, H]``."""
    pooled: dict[str, torch.Tensor] = {}
    states: dict[str, torch.Tensor] = {}
    if mode == "last":
        done = [c for c in chunks if c.completes]
        if done:
            rows = hidden.index_select(0, _rows([c.last - 1 for c in done], hidden.device))
            pooled = dict(zip((c.request_id for c in done), rows))
        return pooled, states
    if mode == "cls":
        firsts = [c for c in chunks if c.start == 0]
        fresh = {}
        if firsts:
            rows = hidden.index_select(0, _rows([c.first for c in firsts], hidden.device))
            fresh = dict(zip((c.request_id for c in firsts), rows))
        for c in chunks:
            value = fresh.get(c.request_id, c.state)
            (pooled if c.completes else states)[c.request_id] = value
        return pooled, states
    reduced = _segment_reduce(hidden, chunks, mode)
    for c, value in zip(chunks, reduced):
        if c.state is not None:
            value = value + c.state if mode == "mean" else torch.maximum(value, c.state)
        if c.completes:
            pooled[c.request_id] = (value / c.length if mode == "mean" else value).to(hidden.dtype)
        else:
            states[c.request_id] = value
    return pooled, states


def pool_step(
    hidden: torch.Tensor, batch: ScheduledBatch, pooling: PoolingModel
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A pooling model's step on its hidden states ``[T, H]``: ``(answers, states)``, the answer
    of each request whose prompt the step completes (``PoolingModel.finish``) and the running
    state of each that goes on."""
    chunks = pooled_chunks(batch)
    pooled, states = pool_chunks(hidden, chunks, pooling.pooling)
    if not pooled:
        return {}, states
    params = {c.request_id: c.params for c in chunks}
    ids = list(pooled)
    rows = torch.stack([pooled[i] for i in ids])
    return dict(zip(ids, pooling.finish(rows, [params[i] for i in ids]))), states


def _rows(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def _segment_reduce(hidden: torch.Tensor, chunks: list[PooledChunk], mode: str) -> torch.Tensor:
    """Each chunk's sum (fp32) or lane-wise max of its rows: ``[len(chunks), H]``."""
    lengths = [c.last - c.first for c in chunks]
    rows = torch.cat([torch.arange(c.first, c.last) for c in chunks]).to(hidden.device)
    segment = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lengths)).to(
        hidden.device
    )
    values = hidden.index_select(0, rows).float()
    out = torch.zeros(len(chunks), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if mode == "mean":
        return out.index_add_(0, segment, values)
    index = segment[:, None].expand_as(values)
    return out.fill_(float("-inf")).scatter_reduce_(0, index, values, "amax")
