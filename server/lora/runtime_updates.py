"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: vLLM's runtime LoRA
updates, routed only when the environment variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is
``1`` or ``true`` (as vLLM; else those paths are unknown routes, 404). Like every ``/v1`` route
they need an API key when the server has keys.

Load reads and checks the adapter's files in a worker thread and registers it between two
engine steps (``AsyncAdapters.load``), so the event loop never waits on a file or a step. The
replies are vLLM's: 200 with a plain-text success line; a refused adapter is a 400 whose message
says why (``AdapterError``), and so is a name already served (an adapter's or the base
model's); unloading a name no adapter has is a 404. Unloading takes the name away at once: new
requests naming it get 404, and the requests already running on it finish on it.
"""

from __future__ import annotations

import logging
import os

from aiohttp import web

from paged_serve.engine.lora.adapter_files import AdapterError
from paged_serve.engine.lora.async_adapters import AsyncAdapters
from paged_serve.server.protocol.decode import decode
from paged_serve.server.protocol.errors import APIError, bad_request
from paged_serve.server.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from paged_serve.server.state import STATE, ServerState

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def runtime_updates_allowed(environ: dict[str, str] | None = None) -> bool:
    """Whether ``RUNTIME_LORA_ENV`` is ``1`` or ``true`` (any case) in ``environ`` (default:
    the process's environment), vLLM's test."""
    value = (os.environ if environ is None else environ).get(RUNTIME_LORA_ENV, "0")
    return value.strip().lower() in ("1", "true")


def _adapters(state: ServerState) -> AsyncAdapters:
    """The engine's adapters; 400 when the server runs without ``--enable-lora``."""
    state.check_engine_alive()
    loras = state.engine.loras
    if loras is None:
        raise bad_request(
            "this server serves no LoRA adapters: start it with --enable-lora", "lora_name"
        )
    return loras


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), LoadLoRAAdapterRequest)
    body.check()
    loras = _adapters(state)
    if body.lora_name in state.model_names or loras.get(body.lora_name) is not None:
        raise bad_request(f"the name {body.lora_name!r} is already served", "lora_name")
    try:  # a name taken meanwhile by a concurrent load is refused there, as AdapterError
        adapter = await loras.load(
            body.lora_name, body.lora_path, reserved=frozenset(state.model_names)
        )
    except AdapterError as exc:
        raise bad_request(str(exc), "lora_path") from None
    logger.info(
        "loaded LoRA adapter %r (rank %d) from %s", adapter.name, adapter.rank, adapter.path
    )
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), UnloadLoRAAdapterRequest)
    body.check()
    loras = _adapters(state)
    try:
        adapter = await loras.unload(body.lora_name)
    except KeyError:
        raise APIError(
            404,
            f"no LoRA adapter {body.lora_name!r} is served",
            param="lora_name",
            code="lora_adapter_not_found",
        ) from None
    logger.info("unloaded LoRA adapter %r", adapter.name)
    return web.Response(text=f"Success: LoRA adapter '{adapter.name}' removed successfully.")


def add_runtime_update_routes(app: web.Application) -> None:
    """Route the load and unload endpoints on ``app``."""
    app.router.add_post(LOAD_PATH, load_lora_adapter)
    app.router.add_post(UNLOAD_PATH, unload_lora_adapter)
