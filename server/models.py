"""``GET /v1/models`` and ``GET /v1/models/{id}``: the card of the one model this server runs.

``max_model_len`` is the longest sequence (prompt plus output, in tokens) a request may ask
for: the model's context, or the whole KV cache if that is smaller.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from server.state import STATE, ServerState
from server.wire import json_response


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int  # Unix seconds: when the server started
    owned_by: str = "paged-serve"
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name, created=state.created, max_model_len=state.context_limit
    )


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(data=[_card(request.app[STATE])]))


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_model(request.match_info["model"])
    return json_response(_card(state))
