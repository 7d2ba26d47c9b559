"""The asyncio-facing engine: ``add_request`` returns an async iterator of outputs.

The synchronous ``LLMEngine`` runs in its own thread so a forward pass never blocks the event
loop; the thread that built it frees its OpenMP workers for that thread
(engine/platform/cpu/openmp_pool.py).
Requests and aborts reach that thread through a locked inbox; outputs come back to each
request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. Validation (tokenizing, length
and capacity checks, the waiting-queue limit) happens in the caller, so a bad request raises
before any stream starts.

If the engine loop itself dies, every stream in flight ends with ``EngineDeadError`` and
``is_alive`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.compiles import GrammarCompiles
from paged_serve.engine.grammar.probe import ProbeBudget
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.observe.engine_state import EngineState, StateWatch
from paged_serve.engine.observe.metrics import EngineStats, SnapshotCollector
from paged_serve.engine.outputs import RequestOutput
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.admission import check_cache_salt
from paged_serve.engine.sched.forks import sample_ids
from paged_serve.engine.sched.request import RequestStatus
from paged_serve.engine.spec.speculator import Speculator

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can make progress."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows."""


@dataclass(frozen=True, slots=True)
class _Add:
    """A request in the inbox, validated, on its way to the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    probe: bool


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges for /metrics, read under the engine lock."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_steps: int
    num_graph_steps: int
    # Speculative decoding (engine/spec/speculator.py SpecStats; zeros when it is off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


def spec_counts(speculator: Speculator | None) -> dict:
    """The snapshot's speculative-decoding fields (none when the engine does not speculate)."""
    if speculator is None:
        return {}
    stats = speculator.stats
    return {
        "spec_drafts": stats.num_drafts,
        "spec_draft_tokens": stats.num_draft_tokens,
        "spec_accepted_tokens": stats.num_accepted_tokens,
        "spec_accepted_per_position": tuple(stats.accepted_per_position),
    }


class AsyncEngine:
    """Owns an LLMEngine and the thread that steps it."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        max_waiting: int | None = None,
    ):
        self.engine = LLMEngine(config, loaded=loaded)
        self.max_waiting = max_waiting
        grammars = self.engine.grammars
        self.compiles = (
            GrammarCompiles(
                grammars,
                ProbeBudget(
                    cpu_s=config.grammar_compile_timeout_s,
                    memory_bytes=config.grammar_compile_memory,
                    fill_s=config.grammar_fill_timeout_s,
                ),
                config.max_pending_grammar_compiles,
            )
            if grammars is not None
            else None
        )
        self._lock = threading.Lock()  # guards the inbox and the streams; held only briefly
        self._wake = threading.Condition(self._lock)
        self._state_lock = threading.Lock()  # held by the engine thread while it steps
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._flushes: list[concurrent.futures.Future] = []  # prefix-cache resets asked
        self._probes: set[str] = set()  # live health-probe requests (outside max_waiting)
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.dead: BaseException | None = None
        self._in_transit = 0  # requests taken from the inbox into the running step
        self._snapshot = self._take_snapshot()
        self.engine.stats.registry.register(SnapshotCollector(self.snapshot))
        self.state_watch = StateWatch()  # the dashboard's detailed state, taken when watched
        # The engine thread's OpenMP pool must be the only one, or libgomp stops spinning
        # between parallel regions and every CPU step slows down
        # (engine/platform/cpu/openmp_pool.py).
        self.engine.platform.release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="paged-serve-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- public API
    @property
    def is_alive(self) -> bool:
        """The loop runs (and, under tensor parallelism, every worker process does)."""
        return self.dead is None and self._thread.is_alive() and self.engine.workers_alive

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The configuration the engine was built with."""
        return self.engine.config

    @property
    def model_config(self) -> object:
        """The model's ``transformers`` config (``model_type``, ``architectures``, ...)."""
        return self.engine.loaded.model.config

    @property
    def generation_config(self) -> object | None:
        """The model's ``transformers.GenerationConfig`` (None if it has none)."""
        return getattr(self.engine.loaded.model, "generation_config", None)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the cache holds ``snapshot().kv_blocks_total`` of them)."""
        return self.engine.block_manager.block_size

    @property
    def stats(self) -> EngineStats:
        """Counters and latency histograms since start; ``stats.registry`` holds every metric
        ``/metrics`` reports, the snapshot's gauges included."""
        return self.engine.stats

    async def compile_grammar(self, constraint: StructuredOutput) -> None:
        """Compile a structured-output constraint into the engine's cache, within the budget
        (engine/grammar/compiles.py). Raises InvalidRequestError or CompileQueueFullError."""
        if self.compiles is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        await self.compiles.compile(constraint)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        probe: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request; iterate the result for its outputs.

        With ``params.n > 1`` the outputs of all ``n`` samples arrive on the one iterator
        (``RequestOutput.index`` tells them apart) until every sample has finished.
        ``cache_salt``: the prefix-cache partition (``LLMEngine.add_request``). ``probe``: a
        health probe, never refused for a full waiting queue and never counted among the
        waiting requests ``max_waiting`` bounds (its caller keeps probes few: one at a time).
        Raises ValueError (bad request), QueueFullError or EngineDeadError before streaming.
        Leaving the iteration early (or cancelling it) aborts every sample.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        check_cache_salt(cache_salt)
        ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, params)
        request_id = request_id or self.new_request_id()
        group = sample_ids(request_id, params.n)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # Checked again under the lock: the loop marks itself dead and shutdown() marks it
            # stopping under this lock, so a request either is registered before that (and gets
            # its error or abort) or is refused here; it never waits on a loop that is gone.
            if self._stopping or self.dead is not None:
                raise EngineDeadError("the engine loop is not running")
            if any(rid in self._streams for rid in group):
                raise ValueError(f"request id {request_id!r} is already in use")
            if not probe and self.max_waiting is not None:
                waiting = self._num_waiting_counted()
                if waiting >= self.max_waiting:
                    raise QueueFullError(
                        f"{waiting} requests are already waiting (limit {self.max_waiting})"
                    )
            for rid in group:
                self._streams[rid] = stream
            if probe:
                self._probes.update(group)
            self._adds.append(_Add(request_id, ids, params, cache_salt, probe))
            self._wake.notify()
        return self._iterate(group, stream)

    def _num_waiting_counted(self) -> int:
        """The waiting requests ``max_waiting`` bounds (lock held): the engine's queue and the
        inbox, less the health probes among them. A probe the engine holds counts as waiting
        while its request's status says so (an attribute read, safe across threads)."""
        waiting = self.engine.num_waiting + len(self._adds)
        if self._probes:
            waiting -= sum(1 for add in self._adds if add.probe)
            live = self.engine.outputs.live
            for rid in self._probes:
                entry = live.get(rid)
                if entry is not None and entry.request.status is RequestStatus.WAITING:
                    waiting -= 1
        return waiting

    async def _iterate(self, group: list[str], stream: _Stream) -> AsyncIterator[RequestOutput]:
        unfinished = set(group)
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in unfinished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step runs."""
        with self._lock:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._wake.notify()

    def snapshot(self) -> EngineSnapshot:
        """The gauges as of the end of the last step (never waits for a running step).

        Requests added since count as waiting, including those the engine thread has taken
        from the inbox into the step now running: an idle snapshot means no request is live.
        """
        with self._lock:
            snap = self._snapshot
            pending = len(self._adds) + self._in_transit
        return replace(snap, num_waiting=snap.num_waiting + pending)

    def _take_snapshot(self) -> EngineSnapshot:
        """The gauges now, in O(1) of the pool size (runs after every step)."""
        e = self.engine
        bm = e.block_manager
        return EngineSnapshot(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            num_preemptions=e.scheduler.num_preemptions,
            prefix_query_tokens=e.scheduler.prefix_query_tokens,
            prefix_hit_tokens=e.scheduler.prefix_hit_tokens,
            num_steps=e.num_steps,
            num_graph_steps=e.num_graph_steps,
            **spec_counts(e.speculator),
        )

    def engine_state(self) -> EngineState | None:
        """The detailed state for the dashboard (``paged_serve.engine.observe.engine_state``); never
        waits for a step.

        Asking marks the state wanted, so the engine thread takes one after its steps for the
        next few seconds (at most every ``MIN_INTERVAL_S``). If the engine is between steps now
        (idle, for one) and the latest state is due, it is taken here. None until a first state
        exists (the engine thread takes one after its current step).
        """
        watch = self.state_watch
        watch.want()
        if self._state_lock.acquire(blocking=False):
            try:
                return watch.take_if_due(self.engine, self._snapshot)
            finally:
                self._state_lock.release()
        return watch.latest

    @contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """Hold the engine thread between two steps and yield the engine to read (tests)."""
        with self._state_lock:
            yield self.engine

    def check_integrity(self) -> None:
        """Check the block pool between steps (raises AssertionError on a leak or bad count)."""
        with self._state_lock:
            self.engine.block_manager.check_integrity()

    async def reset_prefix_cache(self) -> int | None:
        """Evict every cached prefix block, if no request is live (queued, running or on its
        way in); returns the blocks evicted, or None when busy (nothing is touched then: a
        running request's shared blocks keep their keys). Raises EngineDeadError.

        Never waits on a step: a live request answers None at once, and an idle engine's
        thread does the eviction between two steps (``_flush``) while the caller awaits it.
        Taking the state lock here instead would hold the caller's event loop for as long as
        the step running then (a long prefill: seconds, with every stream and ``/health``).
        """
        flush: concurrent.futures.Future[int | None] = concurrent.futures.Future()
        with self._lock:
            if self._stopping or self.dead is not None:
                raise EngineDeadError("the engine loop is not running")
            if self._adds or self._in_transit or self._streams:
                return None
            self._flushes.append(flush)
            self._wake.notify()
        return await asyncio.wrap_future(flush)

    def _flush(self, flushes: list[concurrent.futures.Future]) -> None:
        """Answer the cache resets asked since the last step (engine thread, state lock held,
        before this step's adds: a reset asked while idle is answered as idle)."""
        evicted = None if self.engine.has_unfinished else self.engine.block_manager.evict_cached()
        for flush in flushes:
            if flush.set_running_or_notify_cancel():  # else its caller went away
                flush.set_result(evicted)
            evicted = 0 if evicted is not None else None  # the first reset evicted them all

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop thread."""
        with self._lock:
            self._stopping = True
            self._aborts.extend(self._streams)
            self._wake.notify()
        self._thread.join(timeout)
        if self.compiles is not None:
            self.compiles.close()
        if not self._thread.is_alive():  # never pull the workers from under a running step
            self.engine.shutdown()

    # ----------------------------------------------------------------- the loop
    def _deliver(self, replies: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each reply to its stream's queue (lock held). One wake-up per event loop for the
        whole step, rather than one per token: each wake-up is a write to the loop's self-pipe
        and a turn of the loop, ``len(replies)`` times a step at every batch size."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in replies:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
                self._probes.discard(request_id)
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the client's event loop is closed: nobody is listening
                pass

    def _apply(
        self, adds: list[_Add], aborts: list[str]
    ) -> list[tuple[str, RequestOutput | BaseException]]:
        """Add and abort requests in the engine (engine thread, state lock held)."""
        replies: list[tuple[str, RequestOutput | BaseException]] = []
        for add in adds:
            try:
                self.engine.add_request(
                    add.prompt_ids, add.params, add.request_id, cache_salt=add.cache_salt
                )
            except ValueError as exc:
                replies.append((add.request_id, exc))
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                replies.append((request_id, out))
        return replies

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (
                        self._adds or self._aborts or self._flushes or self.engine.has_unfinished
                    ):
                        if self._stopping:
                            return
                        self._wake.wait()
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    flushes, self._flushes = self._flushes, []
                    self._in_transit = len(adds)
                    stopping = self._stopping
                with self._state_lock:
                    if flushes:
                        self._flush(flushes)
                    replies = self._apply(adds, aborts)
                    if not (stopping and not self.engine.has_unfinished):
                        replies += [(o.request_id, o) for o in self.engine.step()]
                    snapshot = self._take_snapshot()
                    self.state_watch.after_step(self.engine, snapshot)
                with self._lock:
                    self._snapshot, self._in_transit = snapshot, 0
                    self._deliver(replies)
                    for request_id in aborts:  # aborted before the engine knew it
                        self._streams.pop(request_id, None)
                        self._probes.discard(request_id)
                if stopping and not self.engine.has_unfinished:
                    return
        except BaseException as exc:  # the loop is dead: fail every stream rather than hang
            logger.exception("engine loop died")
            with self._lock:
                self.dead = exc
                error = EngineDeadError(f"engine loop died: {exc!r}")
                self._deliver([(request_id, error) for request_id in list(self._streams)])
                flushes, self._flushes = self._flushes, []
            for flush in flushes:
                if flush.set_running_or_notify_cancel():
                    flush.set_exception(error)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """Runs on the event loop: put each item on its queue, in order."""
    for queue, item in items:
        queue.put_nowait(item)
