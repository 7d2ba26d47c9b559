"""Background responses (``background: true``): generations that outlive the request that
started them.

``POST /v1/responses`` starts the engine requests, hands their ``Generation`` to a
``BackgroundRun`` and answers at once (status ``queued``). The run is an asyncio task of its
own, not the handler's: a client that goes away does not cancel it. The task owns the
Generation (leaving it aborts whatever has not finished, so KV blocks come back in the engine's
next step) and stores the final Response; until then ``GET /v1/responses/{id}`` answers from the
run, with an empty ``output``::

    queued --task starts--> in_progress --> completed | incomplete | failed
       |                        |
       +--- cancel, shutdown ---+--> cancelled

With ``stream: true`` the run also keeps the events it produced in an ``EventLog``, so the POST
(and any number of ``GET ...?stream=true&starting_after=N``) read the same numbered events; a
reader that goes away just stops reading. The log holds at most ``max_bytes`` of frames, oldest
dropped first, and lives only while the run does: once it has finished, the stored Response is
what ``GET`` returns.

The runs are bounded: at most ``max_runs`` unfinished at once (``--max-background-responses``,
503 beyond) and, with API keys, ``max_runs_per_key`` per key
(``--max-background-responses-per-key``, 429 beyond), checked before the run's engine
requests are queued. The engine's ``--max-waiting`` bounds them too when it is set.

The events are the foreground stream's (``paged_serve.server.responses.stream``), so
``response.created`` reports ``in_progress``, not ``queued``: the run's task produces it as it
starts. A cancelled run's stream ends without a terminal event (the reference has no
``response.cancelled``; a ``GET`` then says ``cancelled``); a failed one ends with
``response.failed``, its Response carrying ``error``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import AsyncGenerator

from aiohttp import web

from paged_serve.server.generation.run import Generation
from paged_serve.server.http.sse import frame
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError, bad_request, internal_error
from paged_serve.server.protocol.responses import ErrorEvent, Response, ResponseEvent
from paged_serve.server.responses.reply import ResponseReply
from paged_serve.server.responses.stream import ResponseStream

logger = logging.getLogger(__name__)

# Per streamed run. A frame is ~300-500 bytes (one token's delta, with logprobs more), so this
# keeps tens of thousands of events: a whole long reply, for any reader not hours behind.
MAX_EVENT_BYTES = 16 << 20
# How long shutdown waits for cancelled runs to record their status (they stop at their next
# await, so this is a bound, not an expected wait).
SHUTDOWN_WAIT_S = 5.0


class EventLog:
    """A run's stream frames, numbered as their ``sequence_number`` (0, 1, ...)::

        dropped        first                         end
        [0 ... first-1][frame first | ... | end - 1] <- append
                             ^ a reader's next frame

    Appends beyond ``max_bytes`` drop the oldest frames (always keeping the newest). Readers
    wait on an Event replaced at every change, so none misses a wake-up.
    """

    def __init__(self, max_bytes: int = MAX_EVENT_BYTES):
        self.max_bytes = max_bytes
        self.first = 0  # the number of the oldest frame kept
        self.nbytes = 0
        self.closed = False
        self._frames: deque[bytes] = deque()
        self._changed = asyncio.Event()

    @property
    def end(self) -> int:
        """The number the next frame will have."""
        return self.first + len(self._frames)

    def append(self, data: bytes) -> None:
        self._frames.append(data)
        self.nbytes += len(data)
        while self.nbytes > self.max_bytes and len(self._frames) > 1:
            self.nbytes -= len(self._frames.popleft())
            self.first += 1
        self._wake()

    def close(self) -> None:
        """No more frames: readers end once they have read the last."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def check_resumable(self, after: int) -> None:
        """400 naming ``starting_after`` if frames after ``after`` were already dropped."""
        if after + 1 < self.first:
            raise bad_request(
                f"events up to {self.first - 1} are no longer kept (a stream keeps its last "
                f"{self.max_bytes} bytes of events); resume with starting_after >= "
                f"{self.first - 1}",
                "starting_after",
            )

    async def follow(self, after: int) -> AsyncGenerator[bytes, None]:
        """Every frame numbered after ``after``, as they come, until the log closes. A reader
        that falls so far behind that its next frame was dropped gets an ``error`` event
        (numbered as that frame) and its stream ends."""
        position = after + 1
        while True:
            changed = self._changed
            while position < self.end:
                if position < self.first:
                    yield self.error_frame(
                        APIError(
                            410,
                            f"this stream fell too far behind: events up to {self.first - 1} "
                            "are no longer kept; GET the response once it has finished",
                            code="stream_events_dropped",
                        ),
                        position,
                    )
                    return
                yield self._frames[position - self.first]
                position += 1
            if self.closed:
                return
            await changed.wait()

    def error_frame(self, err: APIError, number: int | None = None) -> bytes:
        """An ``error`` event for one reader; it takes no number from the run's sequence."""
        event = ErrorEvent(
            code=err.code,
            message=err.message,
            param=err.param,
            sequence_number=self.end if number is None else number,
        )
        return frame(event, event=event.type)


class BackgroundRun:
    """One background response: its task, its status and, when streamed, its events."""

    def __init__(
        self,
        reply: ResponseReply,
        generation: Generation,
        *,
        stream: bool,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ):
        self.reply = reply
        self.generation = generation
        self.events = ResponseStream(reply)  # numbers the events, the last one included
        self.log = EventLog(max_event_bytes) if stream else None
        self.started = False
        self.final: Response | None = None  # set once the task has ended
        self.done = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def id(self) -> str:
        return self.reply.id

    @property
    def owner(self) -> str | None:
        return self.reply.owner

    @property
    def status(self) -> str:
        if self.final is not None:
            return self.final.status
        return "in_progress" if self.started else "queued"

    def snapshot(self) -> Response:
        """The Response as it stands: the final one, or the running one without output."""
        return self.final or self.reply.running(self.status)

    def start(self) -> asyncio.Task:
        """Start the task (whoever calls this keeps it: the loop holds tasks weakly)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.id)
        self._task.add_done_callback(self._finished)
        return self._task

    async def _run(self) -> Response:
        self.started = True
        reply = self.reply
        if self.log is None:
            return await reply.complete(self.generation)
        async for data in self.events.frames(self.generation):
            self.log.append(data)
        assert reply.final is not None  # the stream stored it before its last event
        return reply.final

    def _finished(self, task: asyncio.Task) -> None:
        """Record how the run ended. A done callback, not a ``finally``: a task cancelled before
        its first step never runs its coroutine, and its requests must still be aborted."""
        self.generation.close()
        if task.cancelled():
            self.final = self.reply.ended("cancelled")
        elif (exc := task.exception()) is not None:
            if not isinstance(exc, APIError):
                logger.error("background response %s failed", self.id, exc_info=exc)
                exc = internal_error()
            self.final = self.reply.ended("failed", exc)
            if self.log is not None:
                failed = ResponseEvent(type="response.failed", response=self.final)
                self.log.append(self.events.frame(failed))
        else:
            self.final = task.result()
        if self.log is not None:
            self.log.close()
        self.done.set()

    async def cancel(self) -> Response:
        """Cancel the run and wait until it has recorded its end; its final Response (which
        is ``completed`` or the like if it finished first)."""
        if self._task is not None:
            self._task.cancel()
        await self.done.wait()
        assert self.final is not None
        return self.final


class BackgroundRuns:
    """The runs that have not finished, by response id. Event loop only.

    At most ``max_runs`` at once, and ``max_runs_per_key`` for each API key (``owner``, the
    key's digest; requests without a key are not counted per key): ``check_room`` refuses the
    next one, and a run is counted from ``start`` until its task has ended.
    """

    def __init__(
        self,
        max_runs: int = 128,
        max_runs_per_key: int = 32,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ):
        self.max_runs = max_runs
        self.max_runs_per_key = max_runs_per_key
        self.max_event_bytes = max_event_bytes
        self._runs: dict[str, BackgroundRun] = {}
        self._per_owner: Counter[str | None] = Counter()

    def __len__(self) -> int:
        return len(self._runs)

    def check_room(self, owner: str | None) -> None:
        """Raise APIError unless one more run fits: 429 when ``owner`` (an API key) holds its
        share, 503 when the server holds its total."""
        if owner is not None and self._per_owner[owner] >= self.max_runs_per_key:
            raise APIError(
                429,
                f"this API key has {self._per_owner[owner]} background responses unfinished, "
                f"the most one key may have (--max-background-responses-per-key); wait for one "
                "to finish or cancel one",
                code="too_many_background_responses",
            )
        if len(self._runs) >= self.max_runs:
            raise APIError(
                503,
                f"the server has {len(self._runs)} background responses unfinished, its limit "
                "(--max-background-responses); retry later",
                type=SERVER_ERROR,
                code="too_many_background_responses",
            )

    def start(self, reply: ResponseReply, generation: Generation, *, stream: bool) -> BackgroundRun:
        """Start a run that owns ``generation`` (from here on nothing else may close it). The
        caller checked ``check_room`` with no await since."""
        run = BackgroundRun(reply, generation, stream=stream, max_event_bytes=self.max_event_bytes)
        self._runs[run.id] = run
        self._per_owner[run.owner] += 1
        # runs after the run's own callback, which has recorded its end by then
        run.start().add_done_callback(lambda _: self._forget(run))
        return run

    def _forget(self, run: BackgroundRun) -> None:
        if self._runs.pop(run.id, None) is not None:
            self._per_owner[run.owner] -= 1
            if not self._per_owner[run.owner]:
                del self._per_owner[run.owner]

    def get(self, response_id: str, owner: str | None) -> BackgroundRun | None:
        """The unfinished run if ``owner`` started it (else None, as the store does)."""
        run = self._runs.get(response_id)
        return run if run is not None and run.owner == owner else None

    async def cancel_all(self) -> None:
        """Shutdown: cancel every run and wait (bounded) until each has recorded ``cancelled``."""
        runs = list(self._runs.values())
        if not runs:
            return
        logger.info("cancelling %d background response(s)", len(runs))
        waits = [asyncio.ensure_future(run.cancel()) for run in runs]
        _, pending = await asyncio.wait(waits, timeout=SHUTDOWN_WAIT_S)
        for wait in pending:
            wait.cancel()


BACKGROUND = web.AppKey("paged_serve_background", BackgroundRuns)
