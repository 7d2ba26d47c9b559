"""``GET /metrics``: the engine's registry (``paged_serve.engine.observe.metrics``) in the
Prometheus text exposition format, version 0.0.4, rendered by ``prometheus_client``.

Every metric has HELP and TYPE lines; counters end in ``_total``; histograms have
``_bucket{le=...}``, ``_sum`` and ``_count`` (and prometheus_client's ``_created``).
``paged_serve_kv_blocks_used`` counts blocks held by live requests only; blocks that sit in the
prefix cache with no request holding them are ``paged_serve_kv_blocks_cached``. Every figure
vLLM also reports is there a second time under vLLM's name and labels
(``paged_serve.engine.observe.vllm_names``), labelled with the first served model name.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.observe.vllm_names import VllmNames
from paged_serve.server.state import STATE


def render(engine: AsyncEngine, model_name: str) -> bytes:
    """The exposition text for ``engine``'s current state, vLLM's names labelled
    ``model_name``."""
    return generate_latest(VllmNames(engine.stats.registry, model_name))  # type: ignore[arg-type]


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = render(state.engine, state.served_model_name)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
