"""The OpenAI error object, and the exception every handler raises to produce one.

Every failure the server reports has the same body, whatever its status::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

``APIError`` carries that object plus the HTTP status; the error middleware in
``paged_serve.server.app`` turns it (and aiohttp's own HTTP exceptions, msgspec decode errors and
unexpected exceptions) into a JSON response (``paged_serve.server.http.errors``). Streams that
already sent their headers send the same object as an SSE frame instead. ``param`` and ``code``
are always present, ``null`` when there is none.
"""

from __future__ import annotations

import re

import msgspec

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# msgspec reports where a value failed as a JSONPath suffix: "... - at `$.messages[0].content`";
# a dict key as "- at `key` in `$.metadata`", a dict value as "- at `$.metadata[...]`".
_PATH = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


class ErrorObject(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None  # the request field at fault, as a path like "messages[0].content"
    code: str | None


class ErrorBody(msgspec.Struct):
    """What every failure sends: ``{"error": {...}}``."""

    error: ErrorObject


class APIError(Exception):
    """A failure to report to the client as the OpenAI error object with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> ErrorBody:
        """The ``{"error": {...}}`` object."""
        return ErrorBody(
            ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code)
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(exc: Exception) -> APIError:
    """503 ``queue_full``: a queue the request needs (waiting requests, grammar compiles) is
    at its limit; ``exc`` says which."""
    return APIError(503, f"the server is overloaded: {exc}", type=SERVER_ERROR, code="queue_full")


def internal_error() -> APIError:
    """500 for what nobody expected; the traceback goes to the log, never to the client."""
    return APIError(500, "internal server error", type=SERVER_ERROR)


def from_decode_error(exc: msgspec.DecodeError) -> APIError:
    """400 for a body msgspec could not decode; ``param`` names the offending field if known."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {exc}")
    message = str(exc)
    path, what = "", "value for"
    match = _PATH.search(message)
    if match:
        path = match.group("path")
        message = message[: match.start()]
        if match.group("key"):
            what = "key in"
        elif path.endswith("[...]"):
            path, what = path.removesuffix("[...]"), "value in"
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group('field')}"
    param = path.lstrip(".") or None
    if param and not missing:
        message = f"invalid {what} {param}: {message}"
    return bad_request(message, param=param)
