"""Each request's asyncio stream of outputs, fed from the engine thread.

The ``n`` samples of a request share one ``asyncio.Queue`` on the event loop that added it.
After a step the engine thread hands every reply to its queue with one
``loop.call_soon_threadsafe`` per event loop (``deliver``), not one per token. A stream closes
at its sample's finished output or error. ``RequestStreams`` has no lock of its own: the engine
loop's lock guards it (engine/engine_loop.py), and every method runs with that lock held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from paged_serve.engine.outputs import RequestOutput


@dataclass(slots=True)
class Stream:
    """Where a request's outputs go: a queue on the event loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStreams:
    """The open streams by sample id, and which of them are health probes (``probes``)."""

    def __init__(self) -> None:
        self._streams: dict[str, Stream] = {}
        self.probes: set[str] = set()  # live health-probe requests (outside max_waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __bool__(self) -> bool:
        return bool(self._streams)

    def ids(self) -> list[str]:
        """The sample ids with an open stream."""
        return list(self._streams)

    def open(self, group: Iterable[str], stream: Stream, *, probe: bool) -> None:
        """Send the outputs of every sample id in ``group`` to ``stream``."""
        group = list(group)
        for request_id in group:
            self._streams[request_id] = stream
        if probe:
            self.probes.update(group)

    def close(self, request_ids: Iterable[str]) -> None:
        """Forget these streams (requests aborted before the engine knew them)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
            self.probes.discard(request_id)

    def deliver(self, replies: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each reply to its stream's queue. One wake-up per event loop for the whole
        step, rather than one per token: each wake-up is a write to the loop's self-pipe and a
        turn of the loop, ``len(replies)`` times a step at every batch size."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in replies:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
                self.probes.discard(request_id)
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the client's event loop is closed: nobody is listening
                pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """Runs on the event loop: put each item on its queue, in order."""
    for queue, item in items:
        queue.put_nowait(item)
