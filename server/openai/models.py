"""``GET /v1/models`` and ``GET /v1/models/{id}``: a card per served name of the one model this
server runs (``--served-model-name`` may give it several).

``max_model_len`` is the longest sequence (prompt plus output, in tokens) a request may ask
for: the model's context, or the whole KV cache if that is smaller. ``quantization`` says how
the checkpoint stores its weights (null: unquantized), as the start-up log does.
"""

from __future__ import annotations

from aiohttp import web

from paged_serve.server.http.wire import json_response
from paged_serve.server.protocol.models import ModelCard, ModelList
from paged_serve.server.state import STATE, ServerState


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(
        id=name,
        created=state.created,
        max_model_len=state.context_limit,
        quantization=state.engine.weights.quantization,
    )


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(ModelList(data=[_card(state, name) for name in state.model_names]))


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    state.check_model(name)
    return json_response(_card(state, name))
