"""The engine thread's loop: take what the event loops asked for, step the engine, deliver.

::

    any thread (AsyncEngine)                      the engine thread (EngineLoop.run)
    add_request / abort / reset_prefix_cache
      -> inbox: adds, aborts, flushes   (lock)    take the inbox                       (lock)
                                                  flushes, adds and aborts, step(),
                                                  gauges, dashboard state        (state lock)
    the request's asyncio.Queue <-------------    deliver the replies                  (lock)

``lock`` guards the inbox and the request streams (engine/request_streams.py) and is held only
briefly; the engine thread holds ``state_lock`` while it touches the engine, so a reader that
wants the engine between two steps (the dashboard's state, tests) takes that lock instead.
The thread sleeps on ``wake`` while there is nothing to do.

If the loop itself dies, every stream in flight ends with ``EngineDeadError``, and so does
every cache reset waiting on it; ``dead`` holds the cause.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from paged_serve.engine.errors import EngineDeadError
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.engine.observe.engine_snapshot import EngineSnapshot, take_snapshot
from paged_serve.engine.observe.engine_state import EngineState, StateWatch
from paged_serve.engine.outputs import RequestOutput
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.request_streams import RequestStreams
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.request import RequestStatus

logger = logging.getLogger("paged_serve.engine.async_engine")  # the name it logged under

Replies = list[tuple[str, RequestOutput | BaseException]]


@dataclass(frozen=True, slots=True)
class PendingAdd:
    """A request in the inbox, validated, on its way to the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    probe: bool
    pooling: PoolingParams | None = None
    images: MultimodalPrompt | None = None  # a prompt with images (its ids are prompt_ids)
    lora: str | None = None  # the LoRA adapter's name


class EngineLoop:
    """The inbox the event loops fill and the loop (``run``) that steps ``engine`` with it,
    delivering to ``streams``; ``snapshot`` holds the gauges as of the last step."""

    def __init__(self, engine: LLMEngine, streams: RequestStreams):
        self.engine = engine
        self.streams = streams
        self.lock = threading.Lock()  # guards the inbox and the streams; held only briefly
        self.wake = threading.Condition(self.lock)
        self.state_lock = threading.Lock()  # held by the engine thread while it steps
        self._adds: list[PendingAdd] = []
        self._aborts: list[str] = []
        self._flushes: list[concurrent.futures.Future] = []  # prefix-cache resets asked
        self.stopping = False
        self.dead: BaseException | None = None
        self._in_transit = 0  # requests taken from the inbox into the running step
        self._snapshot = take_snapshot(engine)
        self.state_watch = StateWatch()  # the dashboard's detailed state, taken when watched

    # ----------------------------------------------------------------- the inbox (lock held)
    @property
    def accepting(self) -> bool:
        """Requests may still come in: the loop is neither stopping nor dead (lock held)."""
        return not self.stopping and self.dead is None

    def post(self, add: PendingAdd) -> None:
        """Queue a validated request for the engine thread (lock held)."""
        self._adds.append(add)
        self.wake.notify()

    def num_waiting_counted(self) -> int:
        """The waiting requests ``max_waiting`` bounds (lock held): the engine's queue and the
        inbox, less the health probes among them. A probe the engine holds counts as waiting
        while its request's status says so (an attribute read, safe across threads)."""
        waiting = self.engine.num_waiting + len(self._adds)
        probes = self.streams.probes
        if probes:
            waiting -= sum(1 for add in self._adds if add.probe)
            live = self.engine.outputs.live
            for rid in probes:
                entry = live.get(rid)
                if entry is not None and entry.request.status is RequestStatus.WAITING:
                    waiting -= 1
        return waiting

    # ----------------------------------------------------------------- any thread
    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step runs."""
        with self.lock:
            if request_id in self.streams:
                self._aborts.append(request_id)
                self.wake.notify()

    def snapshot(self) -> EngineSnapshot:
        """The gauges as of the end of the last step, counting the requests added since (in
        the inbox or taken into the step now running) as waiting."""
        with self.lock:
            snap = self._snapshot
            pending = len(self._adds) + self._in_transit
        return replace(snap, num_waiting=snap.num_waiting + pending)

    def engine_state(self) -> EngineState | None:
        """The dashboard's detailed state (engine/observe/engine_state.py), never waiting for
        a step: taken here if the engine is between steps and the latest is due, else the
        latest the engine thread took (None before the first)."""
        watch = self.state_watch
        watch.want()
        if self.state_lock.acquire(blocking=False):
            try:
                return watch.take_if_due(self.engine, self._snapshot)
            finally:
                self.state_lock.release()
        return watch.latest

    @contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """Hold the engine thread between two steps and yield the engine."""
        with self.state_lock:
            yield self.engine

    def ask_flush(self) -> concurrent.futures.Future[int | None] | None:
        """A prefix-cache reset for the engine thread to do between two steps, or None when a
        request is live (queued, running or on its way in). Raises EngineDeadError."""
        flush: concurrent.futures.Future[int | None] = concurrent.futures.Future()
        with self.lock:
            if not self.accepting:
                raise EngineDeadError("the engine loop is not running")
            if self._adds or self._in_transit or self.streams:
                return None
            self._flushes.append(flush)
            self.wake.notify()
        return flush

    def stop(self) -> None:
        """Abort everything in flight and let the loop end once the engine is idle."""
        with self.lock:
            self.stopping = True
            self._aborts.extend(self.streams.ids())
            self.wake.notify()

    # ----------------------------------------------------------------- the engine thread
    def run(self) -> None:
        """The engine thread's body: until stopped and idle, take the inbox, step, deliver."""
        try:
            while True:
                with self.lock:
                    while not (
                        self._adds or self._aborts or self._flushes or self.engine.has_unfinished
                    ):
                        if self.stopping:
                            return
                        self.wake.wait()
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    flushes, self._flushes = self._flushes, []
                    self._in_transit = len(adds)
                    stopping = self.stopping
                with self.state_lock:
                    if flushes:
                        self._flush(flushes)
                    replies = self._apply(adds, aborts)
                    if not (stopping and not self.engine.has_unfinished):
                        replies += [(o.request_id, o) for o in self.engine.step()]
                    snapshot = take_snapshot(self.engine)
                    self.state_watch.after_step(self.engine, snapshot)
                with self.lock:
                    self._snapshot, self._in_transit = snapshot, 0
                    self.streams.deliver(replies)
                    self.streams.close(aborts)  # aborted before the engine knew them
                if stopping and not self.engine.has_unfinished:
                    return
        except BaseException as exc:  # the loop is dead: fail every stream rather than hang
            logger.exception("engine loop died")
            with self.lock:
                self.dead = exc
                error = EngineDeadError(f"engine loop died: {exc!r}")
                self.streams.deliver([(request_id, error) for request_id in self.streams.ids()])
                flushes, self._flushes = self._flushes, []
            for flush in flushes:
                if flush.set_running_or_notify_cancel():
                    flush.set_exception(error)

    def _flush(self, flushes: list[concurrent.futures.Future]) -> None:
        """Answer the cache resets asked since the last step (state lock held, before this
        step's adds: a reset asked while idle is answered as idle)."""
        evicted = None if self.engine.has_unfinished else self.engine.block_manager.evict_cached()
        for flush in flushes:
            if flush.set_running_or_notify_cancel():  # else its caller went away
                flush.set_result(evicted)
            evicted = 0 if evicted is not None else None  # the first reset evicted them all

    def _apply(self, adds: list[PendingAdd], aborts: list[str]) -> Replies:
        """Add and abort requests in the engine (state lock held)."""
        replies: Replies = []
        for add in adds:
            try:
                self.engine.add_request(
                    add.images or add.prompt_ids,
                    add.params,
                    add.request_id,
                    cache_salt=add.cache_salt,
                    pooling=add.pooling,
                    lora=add.lora,
                )
            except ValueError as exc:
                replies.append((add.request_id, exc))
        for request_id in aborts:
            out = self.engine.abort(request_id)
            if out is not None:
                replies.append((request_id, out))
        return replies
