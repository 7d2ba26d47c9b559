"""Failures as HTTP responses: the OpenAI error object (``paged_serve.server.protocol.errors``)
with its status, and aiohttp's own HTTP exceptions as that object."""

from __future__ import annotations

from aiohttp import web

from paged_serve.server.http.wire import json_response
from paged_serve.server.protocol.errors import INVALID_REQUEST, SERVER_ERROR, APIError


def error_response(err: APIError) -> web.Response:
    return json_response(err.body(), status=err.status)


def from_http_exception(exc: web.HTTPException) -> APIError:
    """aiohttp's own 4xx/5xx (unknown route, wrong method, body too large) as our object."""
    if exc.status == 404:
        message = "no such route"
    elif exc.status == 405:
        message = "method not allowed"
    else:
        message = exc.text or exc.reason
    kind = SERVER_ERROR if exc.status >= 500 else INVALID_REQUEST
    return APIError(exc.status, message, type=kind)
