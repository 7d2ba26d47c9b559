"""The records one step passes between the scheduler and the model runner.

::

    Scheduler.schedule() -> ScheduledBatch   (which requests run, how many tokens each, drafts,
                                              block and state-slot copies to run first)
    ModelRunner.execute(batch) -> StepResult (the token each sampled row drew, logprobs,
                                              prompt scores, rows that failed)
    Scheduler.update(batch, result)           (the scheduler's bookkeeping after the step)

Plain dataclasses, torch-free: the scheduler, the runner, the step's output side and the
draft model's own loop all read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.outputs import TokenLogprob
from paged_serve.engine.sched.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at ``start``.

    A decoding request that speculates also runs its ``draft`` (``engine/spec/``): its last
    token and the drafted ones are the ``num_new_tokens``, and every one of them is scored."""

    request: Request
    start: int
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a token is sampled (a
        pooling request samples nothing: its prompt is pooled)."""
        if self.request.pooling is not None:
            return False
        return self.end - len(self.draft) == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """What one engine step runs. ``block_copies`` are (src, dst) pairs to copy first.

    A hybrid model's step also names each request's linear-attention ``state_slots`` (in
    scheduled order) and the ``state_copies`` (src, dst) of forked sequences, run first.
    ``lora_loads``: the LoRA adapter slots to fill before the forward, ``(slot, adapter)``."""

    requests: list[ScheduledRequest]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    lora_loads: list[tuple[int, LoRAAdapter]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def drafts(self) -> dict[str, tuple[int, ...]]:
        """The drafts this step verifies, by request id (drafted requests only, in order)."""
        return {s.request.request_id: s.draft for s in self.requests if s.draft}


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens for the requests that sample this step, in scheduled order.

    top_logprobs: per sampled row, the ``k`` best (token id, logprob) pairs, where ``k`` is the
    largest ``logprobs`` any request asked for (empty lists when none asked).
    """

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    # Per request id: the prompt tokens this step scored (requests that asked for them only).
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Per request id: which of its rows could not sample this step (0, or a drafted row's
    # position: the tokens of the rows before it stand) and why.
    failed: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Per pooling request id whose prompt this step completed: its answer (an embedding or
    # label scores, engine/pooling/); per one whose prompt goes on: its pooler's running state.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    pool_states: dict[str, object] = field(default_factory=dict)
