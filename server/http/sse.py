"""Server-sent events: frame encoding and the one loop every streaming endpoint uses.

A frame is ``data: {json}\\n\\n``, optionally preceded by ``event: <type>\\n`` (the Responses
API names its events). Each frame is handed to the stream's writer as soon as it is produced.
Once the headers are out an error can no longer change the status, so it becomes a last frame
(``on_error`` decides its shape) and the stream ends.

Frames travel through an ``Outbox``: the handler puts them in, a writer task sends them::

    engine -> frames -> Outbox.put -> [pending] -> writer task -> transport buffer -> socket
                                      '--------- unsent: at most max_unsent_bytes ---------'

The handler never waits on the client, so a client that stops reading cannot make the engine's
outputs pile up unseen behind a blocked write: they pile up here, counted. Once a stream's
unsent bytes pass ``ServerLimits.max_unsent_bytes`` the client is too far behind to be
waited for: the connection is reset (the unsent bytes dropped, the kernel's too) and the
handler returns, which aborts its engine requests. A write that makes no progress at all is
cut by the connection's write timeout (``paged_serve.server.http.connections``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

from aiohttp import web

from paged_serve.server.http.connections import drop_connection
from paged_serve.server.http.wire import encode
from paged_serve.server.protocol.errors import APIError, internal_error
from paged_serve.server.state import STATE

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # ask reverse proxies not to buffer the stream
}


def frame(data: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + encode(data) + b"\n\n"


def error_frame(err: APIError) -> bytes:
    """The chat/completions stream's error frame: ``data: {"error": {...}}``."""
    return frame(err.body())


class UnsentOverflow(Exception):
    """A stream's unsent bytes passed the bound: its client is not keeping up."""

    def __init__(self, unsent_bytes: int, limit: int):
        super().__init__(f"{unsent_bytes} bytes unsent, beyond {limit}")
        self.unsent_bytes = unsent_bytes


class Outbox:
    """One stream's frames on their way to its client: ``put`` never waits; a writer task
    sends what is pending, in order, coalesced into one write when several are waiting.

    ``unsent_bytes`` is what is pending plus what the transport holds (the kernel's socket
    buffers hold more, bounded by the system's ``tcp_wmem``)."""

    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport, limit: int):
        self._response = response
        self._transport = transport
        self._limit = limit
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._finishing = False
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    @property
    def unsent_bytes(self) -> int:
        return self._pending_bytes + self._transport.get_write_buffer_size()

    def put(self, chunk: bytes) -> None:
        """Queue ``chunk``; raises ``UnsentOverflow`` past the bound, or the writer's error
        (a reset connection)."""
        if self._writer.done():
            self._writer.result()  # the error that ended the writer
            raise ConnectionResetError("the stream's writer has stopped")
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        unsent = self.unsent_bytes
        if unsent > self._limit:
            raise UnsentOverflow(unsent, self._limit)
        self._wake.set()

    async def finish(self) -> None:
        """Send everything pending, then end the response (bounded by the write timeout)."""
        self._finishing = True
        self._wake.set()
        await self._writer
        await self._response.write_eof()

    def abort(self) -> None:
        """Drop the connection and whatever it and the kernel had not sent."""
        self._writer.cancel()
        drop_connection(self._transport)

    def close(self) -> None:
        """Stop the writer (idempotent)."""
        if self._writer.done() and not self._writer.cancelled():
            self._writer.exception()  # retrieved: a reset the handler has already seen
        self._writer.cancel()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                data = b"".join(self._pending)
                self._pending.clear()
                self._pending_bytes = 0
                await self._response.write(data)  # waits while the transport is paused
            if self._finishing:
                return


async def respond(
    request: web.Request,
    frames: AsyncGenerator[bytes, None],
    *,
    on_error: Callable[[APIError], bytes] = error_frame,
    done_marker: bool = True,
) -> web.StreamResponse:
    """Stream ``frames`` to the client, then ``data: [DONE]`` if ``done_marker``.

    A client that goes away ends the loop quietly, and so does one that falls more than
    ``max_unsent_bytes`` behind (its connection aborted); the caller's Generation context then
    aborts its requests.
    """
    state = request.app[STATE]
    response = web.StreamResponse(headers=HEADERS)
    outbox: Outbox | None = None
    try:
        await response.prepare(request)
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        outbox = Outbox(response, transport, state.limits.max_unsent_bytes)
        try:
            async for chunk in frames:
                outbox.put(chunk)
        except APIError as err:
            outbox.put(on_error(err))
        except (ConnectionResetError, UnsentOverflow):
            raise
        except Exception:
            logger.exception("a stream failed")
            outbox.put(on_error(internal_error()))
        if done_marker:
            outbox.put(DONE)
        await outbox.finish()
    except UnsentOverflow as overflow:
        state.connections.unsent_overflows += 1
        logger.warning(
            "closed a stream of %s whose client is not reading: %s", request.path, overflow
        )
        if outbox is not None:
            outbox.abort()
    except ConnectionResetError:
        logger.info("client disconnected from %s mid-stream", request.path)
    finally:
        if outbox is not None:
            outbox.close()
        await frames.aclose()
    return response
