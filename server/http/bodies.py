"""Reading a completions, chat or Responses request body (on a server that generates): decoded
once into its Struct (``paged_serve.server.protocol``), checked, naming a served model, within
the server's limits, setting none of the documented fields this server refuses
(``protocol.unsupported``), with the server's sampling defaults where it leaves a field out
(``generation.defaults``)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from aiohttp import web

from paged_serve.server.protocol.chat import ChatCompletionRequest
from paged_serve.server.protocol.completions import CompletionRequest
from paged_serve.server.protocol.decode import decode
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.responses import ResponsesRequest
from paged_serve.server.protocol.unsupported import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    RESPONSES_REFUSED,
    Refused,
    refuse_unsupported,
    refusing,
)
from paged_serve.server.state import STATE

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest, ResponsesRequest)

REFUSED: dict[type, dict[str, Refused]] = {
    CompletionRequest: COMPLETION_REFUSED,
    ChatCompletionRequest: CHAT_REFUSED,
    ResponsesRequest: RESPONSES_REFUSED,
}


async def read_request(request: web.Request, type: type[RequestT]) -> RequestT:
    """The body of ``request`` as ``type``, checked, naming a served model (or none), with the
    server's sampling defaults where it leaves a field out (``generation.defaults``). One decode
    gives the request and the refused fields it sets.

    Raises APIError: 400 naming the bad field (a refused one included) or, before anything is
    read, when the server runs a pooling model (``ServerState.check_generates``); 404 for
    another model.
    """
    state = request.app[STATE]
    state.check_generates(request.path)
    table = REFUSED[type]
    body = decode(await request.read(), refusing(type, table))
    body.check()
    state.check_model(body.model)
    _check_logprob_counts(body, state.limits.max_logprobs)
    refuse_unsupported(body, table)
    if isinstance(body, ResponsesRequest):
        return state.sampling_defaults.fill_responses(body)
    return state.sampling_defaults.fill(body)


def _check_logprob_counts(body: msgspec.Struct, limit: int) -> None:
    """400 naming the field when a request asks for more alternatives than ``--max-logprobs``
    (chat's boolean ``logprobs`` is not a count)."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(body, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise bad_request(
                f"{name} must be at most {limit} on this server (--max-logprobs), got {value}",
                name,
            )
