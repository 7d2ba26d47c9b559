"""Server-sent events: frame encoding and the one loop every streaming endpoint uses.

A frame is ``data: {json}\\n\\n``, optionally preceded by ``event: <type>\\n`` (the Responses
API names its events). Each frame is written - and so flushed to the socket - as soon as it is
produced. Once the headers are out an error can no longer change the status, so it becomes a
last frame (``on_error`` decides its shape) and the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable

from aiohttp import web

from server.errors import SERVER_ERROR, APIError
from server.wire import encode

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


def internal_error() -> APIError:
    return APIError(500, "internal server error", type=SERVER_ERROR)


async def respond(
    request: web.Request,
    frames: AsyncGenerator[bytes, None],
    *,
    on_error: Callable[[APIError], bytes] = error_frame,
    done_marker: bool = True,
) -> web.StreamResponse:
    """Stream ``frames`` to the client, then ``data: [DONE]`` if ``done_marker``.

    A client that goes away ends the loop quietly; the caller's Generation context then aborts
    its requests.
    """
    response = web.StreamResponse(headers=HEADERS)
    try:
        await response.prepare(request)
        try:
            async for chunk in frames:
                await response.write(chunk)
        except APIError as err:
            await response.write(on_error(err))
        except ConnectionResetError:
            raise
        except Exception:
            logger.exception("a stream failed")
            await response.write(on_error(internal_error()))
        if done_marker:
            await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        logger.info("client disconnected from %s mid-stream", request.path)
    finally:
        await frames.aclose()
    return response
