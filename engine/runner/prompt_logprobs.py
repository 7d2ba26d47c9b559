"""Prompt logprobs: each prompt token's logprob given the tokens before it.

What vLLM's ``prompt_logprobs`` and OpenAI's ``echo`` with ``logprobs`` report, and what
evaluation harnesses sum to score a continuation. Prompt token ``j`` (``j >= 1``) is scored by
the logits at position ``j - 1``; token 0 has no logprob (``None``).

A step that computes positions ``[start, end)`` of a request that asked scores the prompt tokens
``j`` in ``[start + 1, end]`` (the prompt is known, so the last position of a chunk scores the
first token of the next one) that are not scored yet: a chunked or preempted request scores
each token once. The LM head runs on those rows only, ``SCORE_CHUNK_ROWS`` at a time, so a
step's extra memory is bounded by that chunk, not by the prompt. Requests that ask skip the
prefix cache: a cached block has no logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_serve.engine.outputs import TokenLogprob
from paged_serve.engine.sched.batch import ScheduledBatch

SCORE_CHUNK_ROWS = 256


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """One step's scoring work: ``rows[i]`` (a flat token index of the step) scores prompt
    token ``targets[i]``; ``owners`` gives (request id, how many rows) in row order."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[str, int]]
    top_k: int  # alternatives per position: the most any request here asked for


def plan_prompt_scoring(batch: ScheduledBatch) -> PromptScoring | None:
    """The step's scoring rows, or None when no scheduled request needs any."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[str, int]] = []
    top_k = 0
    offset = 0  # the flat index of the request's first token this step
    for sched in batch.requests:
        req = sched.request
        offset, start = offset + sched.num_new_tokens, offset
        if not req.needs_prompt_scoring:
            continue
        first = max(sched.start + 1, len(req.prompt_logprobs))
        last = min(sched.end, req.num_prompt_tokens - 1)
        if first > last:
            continue
        rows += [start + (j - 1 - sched.start) for j in range(first, last + 1)]
        targets += req.prompt_token_ids[first : last + 1]
        owners.append((req.request_id, last + 1 - first))
        top_k = max(top_k, req.params.prompt_logprobs or 0)
    if not rows:
        return None
    return PromptScoring(rows, targets, owners, top_k)


@dataclass(frozen=True, slots=True)
class PromptScores:
    """The device results of a PromptScoring: ``logprobs [R]`` and optional ``top`` (values,
    indices) ``[R, k]``, still on the device."""

    plan: PromptScoring
    logprobs: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None

    def read(self) -> dict[str, list[TokenLogprob]]:
        """Per request id, its newly scored prompt tokens in order (one host sync)."""
        values = self.logprobs.tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in values]
        if self.top is not None:
            top_values, top_indices = self.top
            tops = [list(zip(i, v)) for i, v in zip(top_indices.tolist(), top_values.tolist())]
        out: dict[str, list[TokenLogprob]] = {}
        i = 0
        for request_id, count in self.plan.owners:
            out[request_id] = [
                TokenLogprob(self.plan.targets[r], values[r], tops[r]) for r in range(i, i + count)
            ]
            i += count
        return out


def score_prompt(
    hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], plan: PromptScoring
) -> PromptScores:
    """Run the LM head on the plan's rows of ``hidden [T, H]``, chunk by chunk, keeping each
    row's logprob of its target (fp32 ``log_softmax``) and its top ``plan.top_k``."""
    device = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long).to(device)
    targets = torch.tensor(plan.targets, dtype=torch.long).to(device)
    logprobs, top_values, top_indices = [], [], []
    for lo in range(0, len(plan.rows), SCORE_CHUNK_ROWS):
        chunk = rows[lo : lo + SCORE_CHUNK_ROWS]
        log_probs = torch.log_softmax(lm_head(hidden.index_select(0, chunk)).float(), dim=-1)
        logprobs.append(log_probs.gather(1, targets[lo : lo + SCORE_CHUNK_ROWS, None])[:, 0])
        if plan.top_k > 0:
            values, indices = log_probs.topk(plan.top_k, dim=-1)
            top_values.append(values)
            top_indices.append(indices)
    top = (torch.cat(top_values), torch.cat(top_indices)) if plan.top_k > 0 else None
    return PromptScores(plan, torch.cat(logprobs), top)
