"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Every step spends a token budget (``max_num_batched_tokens``) first on the running requests, in
admission order (a decode costs 1 token, an unfinished prefill takes what is left of the budget,
so long prompts are chunked), then admits waiting requests first come first served while the
budget, the free blocks and ``max_num_seqs`` allow. A request with ``n`` samples takes ``n``
seats at admission (its forks join the running set after its prefill), so the rows sampled in
one step never exceed ``max_num_seqs``. When a running request needs a block and the
pool is empty, the most recently admitted running request is preempted: its blocks are freed and
it goes back to the front of the waiting queue to be recomputed later (its outputs so far are
kept). The oldest request therefore always makes progress, so the loop cannot deadlock as long
as every request fits in the pool on its own (the engine refuses those that cannot).

With ``whole_prompts`` (a bidirectional encoder, whose every token attends to every other) a
prompt is admitted only in a step that can run all of it: prompts are never chunked, and a
request is done in the step that admits it.

With LoRA adapters (``adapter_slots``) a request for an adapter is admitted only when its
adapter holds one of the ``--max-loras`` slots or can be given one (``AdapterSlots``); one that
cannot waits, in its place in the queue, while the requests behind it are considered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from paged_serve.engine.lora.adapter_slots import AdapterSlots
from paged_serve.engine.sched.batch import ScheduledBatch, ScheduledRequest, StepResult
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.forks import detach, group_size, join_forks
from paged_serve.engine.sched.request import Request, RequestStatus


class DraftSource(Protocol):
    """What the scheduler asks of a speculator (engine/spec/speculator.py ``Speculator``)."""

    def drafts(self, candidates: Sequence[Request], num_running: int) -> dict[str, list[int]]:
        """Drafts for the decoding ``candidates`` by request id (absent: none this step)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a sequence that ended."""
        ...


def accepted_lengths(
    drafts: dict[str, Sequence[int]], row_ids: Sequence[str], tokens: Sequence[int]
) -> dict[str, int]:
    """Per drafted request id, how many of its drafts its rows' draws confirmed: the longest
    run ``d1 .. da`` where row ``j`` drew ``d(j+1)`` (engine/sample/sampling_rows.py).

    ``row_ids``/``tokens``: the step's sampled rows in order (a drafted request's ``k + 1``
    rows are consecutive) and the token each drew.
    """
    accepted: dict[str, int] = {}
    i = 0
    while i < len(row_ids):
        draft = drafts.get(row_ids[i])
        if draft is None:
            i += 1
            continue
        a = 0
        while a < len(draft) and tokens[i + a] == draft[a]:
            a += 1
        accepted[row_ids[i]] = a
        i += len(draft) + 1
    return accepted


class Scheduler:
    """Holds the waiting and running queues and builds each step's batch."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculator: DraftSource | None = None,
        whole_prompts: bool = False,
        adapter_slots: AdapterSlots | None = None,
    ):
        self.block_manager = block_manager
        self.adapter_slots = adapter_slots
        self.whole_prompts = whole_prompts
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose blocks are already allocated (a fork) to the running set."""
        request.status = RequestStatus.RUNNING
        self._take_adapter(request)
        self.running.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and reserve their KV slots."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Request] = []
        drafts = self._drafts()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = self._chunk(request, start, budget)
            # Drafts ride on a decode within the budget, never at the cost of a preemption.
            draft = tuple(drafts.get(request.request_id, ())[: budget - num_new])
            if draft and bm.can_append(request.request_id, start + num_new + len(draft)):
                copies += bm.append_slots(request.request_id, start + num_new + len(draft))
                scheduled.append(ScheduledRequest(request, start, num_new + len(draft), draft))
                budget -= num_new + len(draft)
                i += 1
                continue
            while not bm.can_append(request.request_id, start + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                copies += bm.append_slots(request.request_id, start + num_new)
                scheduled.append(ScheduledRequest(request, start, num_new))
                budget -= num_new
                i += 1

        # Admit nothing new in a step that had to preempt: the pool is already short.
        seats = sum(group_size(r) for r in self.running)
        passed: list[Request] = []  # waiting for an adapter slot: they keep their place
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            if seats + group_size(request) > self.max_num_seqs:
                break
            if request.lora is not None and not self.adapter_slots.can_take(request.lora):
                passed.append(self.waiting.popleft())
                continue
            tokens = request.cache_token_ids
            salt = request.prefix_chain
            cached = [] if request.skips_prefix_cache else bm.cached_prefix(tokens, salt)
            start = len(cached) * bm.block_size
            num_new = self._chunk(request, start, budget)
            if self.whole_prompts and num_new < request.num_tokens - start:
                break  # a bidirectional encoder sees its whole prompt in one pass
            if not bm.can_allocate(start + num_new, cached):
                break
            self.waiting.popleft()
            bm.allocate(request.request_id, start + num_new, cached, salt)
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += start
            request.num_computed_tokens = start
            if request.num_preemptions == 0:
                request.num_cached_tokens = start
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self._take_adapter(request)
            self.running.append(request)
            seats += group_size(request)
            scheduled.append(ScheduledRequest(request, start, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

        loads = [] if self.adapter_slots is None else self.adapter_slots.take_loads()
        slots = bm.state_slots
        if slots is None:
            return ScheduledBatch(scheduled, copies, preempted, lora_loads=loads)
        held = [slots.slot(s.request.request_id) for s in scheduled]
        return ScheduledBatch(scheduled, copies, preempted, held, slots.take_copies(), loads)

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """How many of the request's tokens from ``start`` this step runs: all, or as many as
        ``budget`` allows; a chunk that crosses a state-snapshot boundary ends at its last one
        (engine/sched/state_snapshots.py), so the state there can be kept."""
        end = start + min(request.num_tokens - start, budget)
        snapshots = self.block_manager.snapshots
        return (end if snapshots is None else snapshots.chunk_end(start, end)) - start

    def _take_adapter(self, request: Request) -> None:
        """A request joining the running set takes its adapter's slot (if it has one)."""
        if request.lora is not None:
            request.lora_slot = self.adapter_slots.take(request.request_id, request.lora)

    def check_adapter_slots(self) -> None:
        """Raise AssertionError unless exactly the running requests with adapters hold slots
        (no-op without LoRA)."""
        if self.adapter_slots is not None:
            held = {r.request_id: r.lora.id for r in self.running if r.lora is not None}
            self.adapter_slots.check_integrity(held)

    def _release_adapter(self, request: Request) -> None:
        if request.lora is not None:
            self.adapter_slots.release(request.request_id)
            request.lora_slot = -1

    def _drafts(self) -> dict[str, list[int]]:
        """This step's drafts by request id, for the running requests that decode."""
        if self.speculator is None:
            return {}
        decoding = [
            r
            for r in self.running
            if r.num_computed_tokens == r.num_tokens - 1 and not r.pending_forks
        ]
        return self.speculator.drafts(decoding, len(self.running)) if decoding else {}

    def update(self, batch: ScheduledBatch, result: StepResult) -> dict[str, int]:
        """The bookkeeping after ``batch`` ran and drew ``result``: each request's computed
        tokens (a drafted one keeps the KV of the drafts its rows confirmed, the rest is
        trimmed), its full blocks committed to the prefix cache, its scored prompt logprobs,
        then the pending forks of every prompt the step completed join the running set.

        Returns, per drafted request id, how many of its drafts held: the run its rows' draws
        confirmed (``accepted_lengths``), cut at a row that failed to sample."""
        bm = self.block_manager
        accepted = accepted_lengths(batch.drafts, result.request_ids, result.token_ids)
        for request_id, (row, _) in result.failed.items():
            if request_id in accepted:  # a late mask: no draft past that row counts
                accepted[request_id] = min(accepted[request_id], row)
        for sched in batch.requests:
            req = sched.request
            tokens = req.cache_token_ids
            if sched.draft:  # the accepted drafts' KV stays, the rejected ones' is dropped
                held = accepted[req.request_id]
                req.num_computed_tokens = sched.end - len(sched.draft) + held
                bm.trim(req.request_id, req.num_computed_tokens)
                tokens += sched.draft[:held]  # appended to the request by StepOutputs.process
            else:
                req.num_computed_tokens = sched.end
            bm.commit(req.request_id, tokens, req.num_computed_tokens)
            if req.request_id in result.prompt_logprobs:
                req.prompt_logprobs += result.prompt_logprobs[req.request_id]
            if req.pooling is not None:
                req.pool_state = result.pool_states.get(req.request_id)
        for child in join_forks(batch, bm):
            self.add_running(child)
        return accepted

    def finish(self, request: Request, reason: str) -> None:
        """Mark ``request`` finished and free its blocks now, wherever it is queued. Forks still
        waiting on it go on under an heir, queued first (``engine/sched/forks.py``)."""
        heir = detach(request)
        if heir is not None:
            self.waiting.appendleft(heir)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request.request_id)
        self._release_adapter(request)
        if self.speculator is not None:
            self.speculator.release(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it for recomputation, ahead of new arrivals."""
        self.block_manager.free(request.request_id)
        self._release_adapter(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
