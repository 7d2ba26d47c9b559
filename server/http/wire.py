"""How every reply body is serialised: one msgspec JSON encoder and ``json_response()``.

Reply bodies are msgspec Structs, as the requests are (``paged_serve.server.protocol``). Each Struct
lists the fields of its OpenAI object in the reference's order, so no place that builds one can drop
a field or misspell it. Two kinds of "no value" are kept apart:

* a field the reference marks nullable is typed ``X | None`` and always sent, ``null`` included
  (``logprobs``, ``finish_reason`` of a stream chunk, ``param`` of an error);
* a field that is sometimes absent altogether (``usage`` on a stream chunk without
  ``stream_options.include_usage``, a chat delta's ``role``) defaults to ``msgspec.UNSET``,
  which the encoder leaves out.

No reply Struct uses ``omit_defaults``: a default value is still sent.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

ENCODER = msgspec.json.Encoder()


def encode(body: object) -> bytes:
    """``body`` (a Struct, or the builtins it holds) as JSON."""
    return ENCODER.encode(body)


def json_response(body: msgspec.Struct | bytes, *, status: int = 200) -> web.Response:
    """An ``application/json`` reply: ``body`` encoded, or sent as it is if it is already JSON
    (a stored response)."""
    data = body if isinstance(body, bytes) else ENCODER.encode(body)
    return web.Response(status=status, body=data, content_type="application/json")
