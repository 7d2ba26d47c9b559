"""A cap on open connections that protects the ones running a request.

Slow clients are bounded three ways (docs/reliability.md):

* the request head: aiohttp closes a connection that has not delivered a complete head within
  its ``keepalive_timeout`` of opening, or of its previous response ending; ``make_runner``
  sets that to ``ServerLimits.header_timeout_s``;
* the body: ``server.app``'s body middleware reads it within ``body_timeout_s`` (else 408);
* the number of connections: ``ConnectionGuard``, here.

The guard is the protocol factory the runner's sites accept through. It keeps every open
connection in one ordered map, least recently idle first, each marked busy while the app runs
a request on it (from the moment its body is in until its handler returns)::

    open: [c3 idle][c1 busy][c7 idle][c2 busy][c9 idle]     (max_connections = 5)
    a new connection arrives: c3, the longest idle, is closed and the newcomer is admitted;
    were all five busy, the newcomer would get a 503 error object and be closed.

So connections that trickle a head or a body, or sit idle, cannot lock a normal client out:
each newcomer displaces the longest-waiting of them, and only requests that are really running
hold their slot. Closing a connection cancels its handler (``handler_cancellation``), so one
evicted mid-body leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from aiohttp import web

from server.errors import SERVER_ERROR, APIError
from server.wire import encode

logger = logging.getLogger(__name__)

# How long a refused connection stays half-open after its 503, so that a request the client
# already sent is read (and dropped) instead of resetting the connection before the client
# has read the answer.
REFUSAL_LINGER_S = 1.0

_REFUSAL_BODY = encode(
    APIError(
        503,
        "the server has too many open connections; try again later",
        type=SERVER_ERROR,
        code="too_many_connections",
    ).body()
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: %d\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n\r\n" % len(_REFUSAL_BODY)
) + _REFUSAL_BODY


class ConnectionGuard:
    """At most ``max_connections`` open; at the cap, a newcomer closes the longest-idle
    connection that is not busy, or is refused (503) when all are busy. Event loop only."""

    def __init__(self, max_connections: int):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.server: web.Server | None = None  # aiohttp's handler factory, set by the runner
        # RequestHandler -> busy, least recently idle first
        self._open: OrderedDict[Any, bool] = OrderedDict()
        self.evicted = 0  # idle connections closed to admit a newcomer
        self.refused = 0  # newcomers refused because every connection was busy

    def __len__(self) -> int:
        return len(self._open)

    def __call__(self) -> asyncio.Protocol:
        """The protocol factory: a connection is admitted (or not) once it is made."""
        return _GuardedConnection(self)

    def admit(self) -> asyncio.Protocol | None:
        """aiohttp's handler for a new connection, making room if needed; None to refuse."""
        if self.server is None:
            raise RuntimeError("the runner has not been set up")
        if len(self._open) >= self.max_connections and not self._evict_idle():
            self.refused += 1
            logger.warning("refused a connection: all %d are running requests", len(self._open))
            return None
        handler = self.server()
        self._open[handler] = False
        return handler

    def release(self, handler: object) -> None:
        self._open.pop(handler, None)

    @contextmanager
    def busy(self, handler: object) -> Iterator[None]:
        """Mark ``handler``'s connection busy (not to be evicted) for the block; when it
        ends the connection is the most recently idle."""
        if handler in self._open:
            self._open[handler] = True
        try:
            yield
        finally:
            if handler in self._open:
                self._open[handler] = False
                self._open.move_to_end(handler)

    def _evict_idle(self) -> bool:
        victim = next((h for h, busy in self._open.items() if not busy), None)
        if victim is None:
            return False
        del self._open[victim]
        victim.force_close()
        self.evicted += 1
        logger.debug("closed the longest-idle connection to admit a new one")
        return True


class _GuardedConnection(asyncio.Protocol):
    """Stands between a transport and aiohttp's RequestHandler, so the guard learns when the
    connection opens and closes; a refused connection never reaches aiohttp."""

    def __init__(self, guard: ConnectionGuard):
        self._guard = guard
        self._handler: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._handler = self._guard.admit()
        if self._handler is not None:
            self._handler.connection_made(transport)
            return
        stream = cast(asyncio.Transport, transport)
        stream.write(_REFUSAL)
        if stream.can_write_eof():
            stream.write_eof()
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, stream.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handler is not None:
            self._guard.release(self._handler)
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            return self._handler.eof_received()
        return None  # a refused connection closes when its client is done

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through ``guard``."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._guard = guard

    @property
    def server(self) -> Any:
        """What sites use as their protocol factory: the guard, in front of aiohttp's."""
        server = super().server
        if server is None:
            return None
        self._guard.server = server
        return self._guard
