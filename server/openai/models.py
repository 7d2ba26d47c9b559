"""``GET /v1/models`` and ``GET /v1/models/{id}``: a card per served name of the one model this
server runs (``--served-model-name`` may give it several), then one per served LoRA adapter
(``--enable-lora``), as vLLM lists them.

``max_model_len`` is the longest sequence (prompt plus output, in tokens) a request may ask
for: the model's context, or the whole KV cache if that is smaller. ``quantization`` says how
the checkpoint stores its weights (null: unquantized), as the start-up log does. ``root`` is the
base model's folder (or id) and an adapter's folder; ``parent`` is null for the base model and,
for an adapter, its ``base_model_name`` when it was given one, else the base model's first
served name.
"""

from __future__ import annotations

from aiohttp import web

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.server.http.wire import json_response
from paged_serve.server.protocol.models import ModelCard, ModelList
from paged_serve.server.state import STATE, ServerState, model_not_found


def _card(state: ServerState, name: str) -> ModelCard:
    engine = state.engine
    return ModelCard(
        id=name,
        created=state.created,
        root=engine.engine.config.model or engine.model_name,
        max_model_len=state.context_limit,
        quantization=engine.weights.quantization,
    )


def _adapter_card(state: ServerState, adapter: LoRAAdapter) -> ModelCard:
    return ModelCard(
        id=adapter.name,
        created=state.created,
        root=adapter.path,
        parent=adapter.base_model_name or state.served_model_name,
        max_model_len=state.context_limit,
        quantization=state.engine.weights.quantization,
    )


def _adapters(state: ServerState) -> list[LoRAAdapter]:
    loras = state.engine.loras
    return [] if loras is None else loras.served()


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [_card(state, name) for name in state.model_names]
    cards += [_adapter_card(state, adapter) for adapter in _adapters(state)]
    return json_response(ModelList(data=cards))


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name in state.model_names:
        return json_response(_card(state, name))
    adapters = _adapters(state)
    for adapter in adapters:
        if adapter.name == name:
            return json_response(_adapter_card(state, adapter))
    raise model_not_found(name, state.model_names + tuple(a.name for a in adapters))
