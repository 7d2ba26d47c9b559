"""A cap on open connections that protects the ones running a request, and a write timeout.

Slow clients are bounded four ways (docs/reliability.md):

* the request head: aiohttp closes a connection that has not delivered a complete head within
  its ``keepalive_timeout`` of opening, or of its previous response ending; ``make_runner``
  sets that to ``ServerLimits.header_timeout_s``;
* the body: ``paged_serve.server.app``'s body middleware reads it within ``body_timeout_s`` (else
408);
* the number of connections: ``ConnectionGuard``, here;
* a client that stops reading: the transport pauses the writer once its buffer passes the
  high-water mark (64 KiB); a connection whose writes stay paused for ``write_timeout_s``
  without its buffer shrinking is aborted here (``_WriteWatch``), whatever was writing - a
  stream, a whole body - and aborting it cancels the handler, whose requests are aborted.
  ``paged_serve.server.http.sse`` bounds, besides, what a stream may hold unsent.

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

A write-stalled connection is dropped (``drop_connection``), not closed: closing waits until
the transport's buffer is sent, which a client that does not read never lets happen, and even a
closed socket keeps what the kernel holds for it (megabytes: its send buffer grows to
``tcp_wmem``'s maximum) while the kernel retries; a reset discards both at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from aiohttp import web

from paged_serve.server.http.wire import encode
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError

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
    connection that is not busy, or is refused (503) when all are busy. A connection whose
    writes make no progress for ``write_timeout_s`` seconds is aborted. Event loop only."""

    def __init__(self, max_connections: int, *, write_timeout_s: float = 600.0):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self.write_timeout_s = write_timeout_s
        self.server: web.Server | None = None  # aiohttp's handler factory, set by the runner
        self.runner: web.BaseRunner | None = None  # whose sites accept through this guard
        # RequestHandler -> busy, least recently idle first
        self._open: OrderedDict[Any, bool] = OrderedDict()
        self.evicted = 0  # idle connections closed to admit a newcomer
        self.refused = 0  # newcomers refused because every connection was busy
        self.write_timeouts = 0  # connections aborted because their client stopped reading
        self.unsent_overflows = 0  # streams cut because their client fell too far behind

    def listens_on_loopback(self) -> bool:
        """Whether the runner's sites listen on loopback addresses only (False before a site
        has started, or for an app served without ``GuardedRunner``)."""
        addresses = self.runner.addresses if self.runner is not None else []
        return bool(addresses) and all(is_loopback_address(a[0]) for a in addresses)

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


def drop_connection(transport: asyncio.BaseTransport) -> None:
    """Close ``transport`` at once with a reset (``SO_LINGER`` 0), discarding what it and the
    kernel still hold for the client; ``connection_lost`` follows, cancelling its handler."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already gone
            pass
    transport.abort()


def is_loopback_address(host: str) -> bool:
    """Whether ``host`` (an IP address as sockets report it) is a loopback one, IPv4-mapped
    IPv6 (``::ffff:127.0.0.1``) included."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class _WriteWatch:
    """Resets ``transport`` once its writes have been paused for the guard's
    ``write_timeout_s`` seconds without its client taking anything. Armed while paused.

    Progress, not the whole pause, is timed: a reply of megabytes read slowly but steadily
    stays paused for long, and must not be cut. The buffer is sampled every quarter of the
    timeout; a sample below the one before means the client took bytes (a writer adds at most
    aiohttp's 64 KiB drain step after the pause begins, then waits), and starts the count
    again."""

    SAMPLES = 4  # per timeout

    def __init__(self, guard: ConnectionGuard, transport: asyncio.Transport):
        self._guard = guard
        self._transport = transport
        self._timer: asyncio.TimerHandle | None = None
        self._buffered = 0  # bytes in the transport's buffer at the last sample
        self._idle = 0  # samples in a row that saw no progress

    def start(self) -> None:
        if self._timer is None:
            self._buffered = self._transport.get_write_buffer_size()
            self._idle = 0
            self._arm()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        period_s = self._guard.write_timeout_s / self.SAMPLES
        self._timer = asyncio.get_running_loop().call_later(period_s, self._sample)

    def _sample(self) -> None:
        self._timer = None
        if self._transport.is_closing():
            return
        buffered = self._transport.get_write_buffer_size()
        self._idle = 0 if buffered < self._buffered else self._idle + 1
        self._buffered = buffered
        if self._idle < self.SAMPLES:
            self._arm()
            return
        self._guard.write_timeouts += 1
        logger.warning(
            "aborted a connection whose client took nothing for %g s (%d bytes unsent)",
            self._guard.write_timeout_s,
            buffered,
        )
        drop_connection(self._transport)


class _GuardedConnection(asyncio.Protocol):
    """Stands between a transport and aiohttp's RequestHandler, so the guard learns when the
    connection opens and closes, and times its paused writes; a refused connection never
    reaches aiohttp."""

    def __init__(self, guard: ConnectionGuard):
        self._guard = guard
        self._handler: Any = None
        self._watch: _WriteWatch | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._handler = self._guard.admit()
        if self._handler is not None:
            self._watch = _WriteWatch(self._guard, cast(asyncio.Transport, transport))
            self._handler.connection_made(transport)
            return
        stream = cast(asyncio.Transport, transport)
        stream.write(_REFUSAL)
        if stream.can_write_eof():
            stream.write_eof()
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, stream.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.stop()
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
        if self._watch is not None:
            self._watch.start()

    def resume_writing(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._handler is not None:
            self._handler.resume_writing()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through ``guard``."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._guard = guard
        guard.runner = self

    @property
    def server(self) -> Any:
        """What sites use as their protocol factory: the guard, in front of aiohttp's."""
        server = super().server
        if server is None:
            return None
        self._guard.server = server
        return self._guard
