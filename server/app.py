"""The aiohttp application: routes, the error and auth middlewares, shutdown, the runner.

Routes::

    GET  /v1/models                   GET  /v1/models/{model}
    POST /v1/completions              POST /v1/chat/completions
    POST /v1/responses                GET|DELETE /v1/responses/{response_id}
    POST /v1/responses/{response_id}/cancel
    POST /v1/embeddings               POST /pooling             POST /classify
    POST /score                       POST /rerank, /v1/rerank, /v2/rerank   (server.pooling)
    POST /tokenize                    POST /detokenize          GET /tokenizer_info
    GET  /health                      GET  /metrics
    GET  /health_generate, /server_info, /model_info, /get_load
    POST /flush_cache, /reset_prefix_cache                    (server.ops.worker_api: routers)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter      (server.lora.runtime_updates:
         routed only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true)
    GET  /, /dashboard                GET  /v1/engine/state    (server.ops.dashboard)

Every failure leaves as the OpenAI error object (``paged_serve.server.http.errors``): the error
middleware catches our APIError, aiohttp's HTTP exceptions (unknown route 404, wrong method 405,
body over ``client_max_size`` 413) and anything unexpected (500 with a generic message; the
traceback goes to the log, never to the client). Then the browser guard refuses what a web page
could make a visitor's browser send - a rebound Host, a cross-site Origin, a body that is not JSON
(``paged_serve.server.http.browser_guard``). With API keys set, every ``/v1`` route needs
``Authorization: Bearer <key>``, and so do the tokenizer routes, vLLM's pooling routes outside
``/v1`` (``POOLING_PATHS``), the two cache resets and ``/health_generate`` (it runs the model);
``/health``, ``/metrics`` and the routers' read-only worker routes stay open. Then the body
middleware reads the whole body within ``ServerLimits.body_timeout_s`` (408 and the connection
closed otherwise) and marks the connection busy for the connection guard while the handler runs
(``paged_serve.server.http.connections``).

The runner cancels a handler whose client disconnects (``handler_cancellation``), which aborts
its engine requests (background responses run in tasks of their own, which it does not touch);
on shutdown every background response is cancelled and every other request in flight aborted,
so each stream ends with a final frame before the server closes. It closes a connection that
takes longer than ``header_timeout_s`` to send a request head, and accepts connections through
the guard, which also aborts a connection whose client stops reading for
``write_timeout_s``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.generation.defaults import NO_DEFAULTS, SamplingDefaults
from paged_serve.server.http.browser_guard import browser_guard_middleware
from paged_serve.server.http.connections import ConnectionGuard, GuardedRunner
from paged_serve.server.http.errors import error_response, from_http_exception
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.http.wire import json_response
from paged_serve.server.lora.runtime_updates import (
    add_runtime_update_routes,
    runtime_updates_allowed,
)
from paged_serve.server.media.config import MediaConfig
from paged_serve.server.openai.chat import create_chat_completion
from paged_serve.server.openai.completions import create_completion
from paged_serve.server.openai.metrics import metrics
from paged_serve.server.openai.models import list_models, retrieve_model
from paged_serve.server.openai.tokenize import TOKENIZER_PATHS, add_tokenizer_routes
from paged_serve.server.ops.dashboard import add_dashboard
from paged_serve.server.ops.worker_api import KEYED_PATHS, add_worker_routes
from paged_serve.server.pooling.classify import create_classification
from paged_serve.server.pooling.embeddings import create_embeddings
from paged_serve.server.pooling.pooling import create_pooling
from paged_serve.server.pooling.rerank import rerank, rerank_v2
from paged_serve.server.pooling.score import create_score
from paged_serve.server.protocol.errors import APIError, internal_error
from paged_serve.server.protocol.ops import HealthStatus
from paged_serve.server.responses.background import BACKGROUND, BackgroundRuns
from paged_serve.server.responses.handlers import (
    cancel_response,
    create_response,
    delete_response,
    retrieve_response,
)
from paged_serve.server.responses.store import ResponseStore
from paged_serve.server.state import OWNER, STATE, ServerState, key_hash

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# vLLM's pooling routes at the server root; with API keys they need one like every /v1 route
POOLING_PATHS = frozenset({"/pooling", "/classify", "/score", "/rerank", "/v2/rerank"})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(from_http_exception(exc))
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(internal_error())


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    hashes = request.app[STATE].api_key_hashes
    path = request.path
    keyed = path in TOKENIZER_PATHS or path in POOLING_PATHS or path in KEYED_PATHS
    if hashes and (path.startswith("/v1") or keyed):
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        given = key_hash(key.strip()) if scheme.lower() == "bearer" else ""
        # compare against every key so the time taken does not say which one matched
        matches = [hmac.compare_digest(given, h) for h in hashes]
        if not any(matches):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        request[OWNER] = given
    return await handler(request)


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the whole body within the body timeout, then run the handler with the connection
    marked busy (the connection guard does not evict it meanwhile)."""
    state = request.app[STATE]
    timeout = state.limits.body_timeout_s
    try:
        # read() caches the body: the handler's own read() returns it at once
        await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        response = error_response(
            APIError(
                408,
                f"the request body did not arrive within {timeout:g} s",
                code="request_timeout",
            )
        )
        response.force_close()
        return response
    with state.connections.busy(request.protocol):
        return await handler(request)


async def health(request: web.Request) -> web.Response:
    request.app[STATE].check_engine_alive()
    return json_response(HealthStatus())


async def _abort_in_flight(app: web.Application) -> None:
    """On shutdown: refuse new work, cancel the background responses (each records
    ``cancelled`` as its task ends, aborting its requests) and abort every other request in
    flight (streams end with a final frame, non-streaming calls get 503)."""
    state = app[STATE]
    state.shutting_down = True
    await app[BACKGROUND].cancel_all()
    if state.in_flight:
        logger.info("aborting %d request(s) in flight", len(state.in_flight))
    for request_id in list(state.in_flight):
        state.engine.abort(request_id)


def create_app(
    engine: AsyncEngine,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_keys: Sequence[str] = (),
    limits: ServerLimits | None = None,
    dashboard: bool = True,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    sampling_defaults: SamplingDefaults = NO_DEFAULTS,
    media: MediaConfig | None = None,
    runtime_lora_updating: bool | None = None,
) -> web.Application:
    """The app serving ``engine`` within ``limits`` (default: ``ServerLimits()``), with the
    dashboard page and its state endpoint unless ``dashboard`` is False. ``served_model_name``
    may be several names (replies carry the first); ``sampling_defaults`` fill the sampling
    fields a request leaves out (``paged_serve.server.generation.defaults``); ``media`` says
    where image inputs may come from and how many (default: ``data:`` URLs only, 8 per
    prompt). ``runtime_lora_updating`` routes ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (default: whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is 1 or
    true, as vLLM). ValueError when a served LoRA adapter has one of the served model names.
    The caller owns the engine (and shuts it down). Serve it with ``make_runner``, which
    applies the connection limits."""
    if any(not key for key in api_keys):
        raise ValueError("API keys must be non-empty strings")
    limits = limits or ServerLimits()
    names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
    names = tuple(names or (engine.model_name,))
    if not all(names):
        raise ValueError("served model names must be non-empty strings")
    taken = [a.name for a in (engine.loras.served() if engine.loras else []) if a.name in names]
    if taken:
        raise ValueError(f"the LoRA adapter name(s) {taken} are served model names too")
    app = web.Application(
        middlewares=[error_middleware, browser_guard_middleware, auth_middleware, body_middleware],
        client_max_size=limits.max_request_bytes,
    )
    app[STATE] = ServerState(
        engine=engine,
        served_model_name=names[0],
        served_model_names=names,
        sampling_defaults=sampling_defaults,
        limits=limits,
        store=ResponseStore(limits.max_stored_responses, limits.max_response_store_bytes),
        connections=ConnectionGuard(limits.max_connections, write_timeout_s=limits.write_timeout_s),
        api_key_hashes=tuple(key_hash(k) for k in api_keys),
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        media=media or MediaConfig(),
    )
    app[BACKGROUND] = BackgroundRuns(
        max_runs=limits.max_background_responses,
        max_runs_per_key=limits.max_background_responses_per_key,
    )
    app.router.add_get("/v1/models", list_models)
    # Hugging Face ids, the default served names, contain "/" ("org/name")
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    # one server per model kind: on a generating model these answer 400 (--runner pooling)
    app.router.add_post("/v1/embeddings", create_embeddings)
    app.router.add_post("/pooling", create_pooling)
    app.router.add_post("/classify", create_classification)
    app.router.add_post("/score", create_score)
    for path in ("/rerank", "/v1/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_post("/v2/rerank", rerank_v2)
    add_tokenizer_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_worker_routes(app)
    if runtime_updates_allowed() if runtime_lora_updating is None else runtime_lora_updating:
        add_runtime_update_routes(app)
    if dashboard:
        add_dashboard(app)
    app.on_shutdown.append(_abort_in_flight)
    return app


def make_runner(app: web.Application, *, shutdown_timeout: float = 10.0) -> web.AppRunner:
    """A runner for ``create_app``'s app that

    * cancels the handler of a client that disconnects (aiohttp does not by default since
      3.7), so its engine requests are aborted at once;
    * closes a connection that has not sent a complete request head ``header_timeout_s``
      after it opened or its previous response ended (aiohttp's ``keepalive_timeout`` is that
      deadline: it closes a connection whose next request has not been parsed by then);
    * accepts connections through the app's connection guard (``max_connections``, and
      ``write_timeout_s`` for a client that stops reading).
    """
    state = app[STATE]
    return GuardedRunner(
        app,
        state.connections,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=state.limits.header_timeout_s,
    )
