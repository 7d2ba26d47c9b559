"""The engine's detailed state for the dashboard, taken between steps and only when watched.

::

    GET /v1/engine/state -> AsyncEngine.engine_state(): StateWatch.want(), then
        the state lock free (the engine is between steps, idle for one)? take_if_due() here
        else: the latest state (the engine thread takes a fresh one after its step)
    engine thread, after every step, state lock held: StateWatch.after_step()
        nobody asked in the last WATCH_WINDOW_S? return (a clock read and a comparison)
        else: take_if_due()
    take_if_due(): the latest state is of this very moment, or not yet due? keep it
        else take one and set when the next is due: after MIN_INTERVAL_S, or after
        take time / MAX_BUSY_FRACTION if that is longer

When nobody watches, ``after_step`` is the whole cost: nothing measurable next to a step.
When someone does, a take costs one pass over the free pool and the block tables
(``BlockManager.pool_map``, ``usage()``, ``check_integrity``) and the running requests: at
most five a second however many watchers poll, and never more than ``MAX_BUSY_FRACTION`` of
the engine thread's time (a pool of hundreds of thousands of blocks is taken every few seconds
instead). The integrity check is most of a take's pool work: 0.31 ms against 0.19 ms for
``pool_map`` and ``usage()`` together at 3,000 blocks, 20.8 against 10.4 ms at 100,000 (timeit,
pools half held, on the 2-core box with a test run beside it).
perf/engine/bench_engine_state.py measures both; the JSON is documented in docs/api.md
("The dashboard: GET / and GET /v1/engine/state").
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_serve.engine.observe.engine_snapshot import EngineSnapshot
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.block_pool import BlockUsage
from paged_serve.engine.sched.request import Request

if TYPE_CHECKING:
    from paged_serve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.2  # at most five takes a second, however many watchers poll
MAX_BUSY_FRACTION = 0.02  # of the engine thread's time spent taking states while watched
WATCH_WINDOW_S = 2.0  # a request keeps the engine thread taking states this long
MAX_WAITING_LISTED = 32  # the head of the waiting queue; its length is in the gauges


@dataclass(frozen=True, slots=True)
class RequestState:
    """One sequence (one of a request's ``n`` samples) as the scheduler sees it."""

    id: str
    status: str  # running | waiting
    prompt_tokens: int
    computed_tokens: int  # tokens whose K/V are in the cache (prompt first, then outputs)
    cached_tokens: int  # prompt tokens served from the prefix cache at admission
    output_tokens: int
    max_tokens: int  # 0 for a pooling request (it generates nothing)
    preemptions: int
    age_s: float  # since arrival
    blocks: list[int]  # its block table (empty while waiting)
    state_slot: int | None = None  # a hybrid model's linear-attention state slot, if it holds one
    pooling: str | None = None  # a pooling request's task (embed | classify); None when generating
    lora: str | None = None  # the LoRA adapter it runs on; None: the base model
    image_tokens: int = 0  # prompt positions that hold its images' placeholders
    image_blocks: list[int] = field(default_factory=list)  # its blocks holding some of them


@dataclass(frozen=True, slots=True)
class BlockPoolState:
    """The block pool: one character per block in ``map`` (see ``BlockManager.pool_map``)."""

    block_size: int
    num_blocks: int
    map: str
    shared_blocks: int  # blocks with ref count > 1, each counted once
    usage: BlockUsage
    copy_on_write_total: int
    recent_copies: list[tuple[int, int]]  # the last (src, dst) copies, oldest first
    integrity: str  # "ok", or what BlockManager.check_integrity found wrong
    # A hybrid model's linear-attention state slots beside the blocks (0 and 0 otherwise).
    state_slots_total: int = 0
    state_slots_used: int = 0
    # Its states kept at block boundaries for prefix hits (engine/sched/state_snapshots.py)
    state_snapshots_total: int = 0
    state_snapshots_used: int = 0
    # What a cached K or V element is stored as: the model's dtype ("float32", "bfloat16") or a
    # quantized cache's codes ("int8", "float8_e4m3fn", ...: --kv-cache-dtype)
    cache_dtype: str = ""


@dataclass(frozen=True, slots=True)
class EngineState:
    """Everything the dashboard draws, as of the end of engine step ``step``.

    ``gauges`` is the ``EngineSnapshot`` that /metrics reads, taken at the same moment.
    """

    time: float  # Unix seconds when taken
    step: int
    gauges: EngineSnapshot
    kv: BlockPoolState
    running: list[RequestState]
    waiting: list[RequestState]


def _request_state(engine: LLMEngine, request: Request, now: float) -> RequestState:
    bm = engine.block_manager
    rid = request.request_id
    slots = bm.state_slots
    pooling = request.pooling.task if request.pooling is not None else None
    return RequestState(
        id=rid,
        status=request.status.value,
        prompt_tokens=request.num_prompt_tokens,
        computed_tokens=request.num_computed_tokens,
        cached_tokens=request.num_cached_tokens,
        output_tokens=len(request.output_token_ids),
        max_tokens=0 if pooling else request.params.max_tokens,
        preemptions=request.num_preemptions,
        age_s=round(now - request.arrival_time, 3),
        blocks=list(bm.block_table(rid)) if bm.has(rid) else [],
        state_slot=slots.slot(rid) if slots is not None and slots.holds(rid) else None,
        pooling=pooling,
        lora=request.lora.name if request.lora is not None else None,
        image_tokens=sum(image.length for image in request.images),
        image_blocks=_image_blocks(request, bm),
    )


def _image_blocks(request: Request, bm: BlockManager) -> list[int]:
    """The blocks of ``request``'s table that hold some of its images' placeholder positions
    (in table order; none while it holds no blocks)."""
    if not request.images or not bm.has(request.request_id):
        return []
    table, size = bm.block_table(request.request_id), bm.block_size
    held = {
        i
        for image in request.images
        for i in range(image.offset // size, (image.end - 1) // size + 1)
        if i < len(table)
    }
    return [table[i] for i in sorted(held)]


def pool_integrity(bm: BlockManager) -> str:
    """``ok`` if the pool's reference counts, free list and cache agree, else the first
    disagreement (so a replica's pool can be checked over HTTP)."""
    try:
        bm.check_integrity()
    except AssertionError as exc:
        return str(exc)
    return "ok"


def take_state(engine: LLMEngine, gauges: EngineSnapshot) -> EngineState:
    """The engine's state now. Call between steps (the caller holds the state lock)."""
    bm = engine.block_manager
    scheduler = engine.scheduler
    now = time.monotonic()
    pool = bm.pool_map()
    kv = BlockPoolState(
        block_size=bm.block_size,
        num_blocks=bm.num_blocks,
        map=pool,
        shared_blocks=pool.count("s"),
        usage=bm.usage(),
        copy_on_write_total=bm.copy_on_write_total,
        recent_copies=list(bm.recent_copies),
        integrity=pool_integrity(bm),
        state_slots_total=0 if bm.state_slots is None else bm.state_slots.num_slots,
        state_slots_used=0
        if bm.state_slots is None
        else bm.state_slots.num_slots - bm.state_slots.num_free,
        state_snapshots_total=0 if bm.snapshots is None else bm.snapshots.count,
        state_snapshots_used=0 if bm.snapshots is None else bm.snapshots.num_used,
        cache_dtype=str(engine.runner.kv_cache.tensor.dtype).removeprefix("torch."),
    )
    waiting = itertools.islice(scheduler.waiting, MAX_WAITING_LISTED)
    return EngineState(
        time=round(time.time(), 3),
        step=engine.num_steps,
        gauges=gauges,
        kv=kv,
        running=[_request_state(engine, r, now) for r in scheduler.running],
        waiting=[_request_state(engine, r, now) for r in waiting],
    )


class StateWatch:
    """Takes ``EngineState``s while someone asks for them, rate-limited.

    ``want()`` and ``latest`` are for any thread; ``take_if_due`` and ``after_step`` run with
    the engine's state lock held. ``clock`` is ``time.monotonic`` but in tests.
    """

    def __init__(
        self,
        min_interval_s: float = MIN_INTERVAL_S,
        window_s: float = WATCH_WINDOW_S,
        max_busy_fraction: float = MAX_BUSY_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_interval_s = min_interval_s
        self.window_s = window_s
        self.max_busy_fraction = max_busy_fraction
        self.clock = clock
        self.latest: EngineState | None = None
        self.num_taken = 0
        self.broken = False  # a take raised: take no more (the engine goes on)
        # Written by any thread, read by the engine thread: one float, so no lock is needed.
        self._wanted_until = float("-inf")
        self._next_due = float("-inf")

    def want(self) -> None:
        """Someone is watching: keep taking states for the next ``window_s`` seconds."""
        if not self.broken:
            self._wanted_until = self.clock() + self.window_s

    def after_step(self, engine: LLMEngine, gauges: EngineSnapshot) -> None:
        """After an engine step: take a state if one is wanted and due."""
        if self.clock() > self._wanted_until:
            return  # nobody watches: this comparison is the whole cost
        try:
            self.take_if_due(engine, gauges)
        except Exception:  # a fault in the dashboard's view must never stop the engine loop
            logger.exception("taking the engine state failed; the dashboard stops updating")
            self._wanted_until = float("-inf")
            self.broken = True

    def take_if_due(self, engine: LLMEngine, gauges: EngineSnapshot) -> EngineState | None:
        """Take a state unless the latest is of this moment (``gauges``, the snapshot of the
        last step) or the next is not due yet; the latest state either way."""
        now = self.clock()
        latest = self.latest
        if self.broken or latest is not None and (latest.gauges is gauges or now < self._next_due):
            return latest
        self.latest = take_state(engine, gauges)
        took = self.clock() - now
        self._next_due = now + max(self.min_interval_s, took / self.max_busy_fraction)
        self.num_taken += 1
        return self.latest
