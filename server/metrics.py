"""``GET /metrics``: the engine's registry (``engine.observe.metrics``) in the Prometheus text
exposition format, version 0.0.4, rendered by ``prometheus_client``.

Every metric has HELP and TYPE lines; counters end in ``_total``; histograms have
``_bucket{le=...}``, ``_sum`` and ``_count`` (and prometheus_client's ``_created``).
``paged_serve_kv_blocks_used`` counts blocks held by live requests only; blocks that sit in the
prefix cache with no request holding them are ``paged_serve_kv_blocks_cached``.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from engine.async_engine import AsyncEngine
from server.state import STATE


def render(engine: AsyncEngine) -> bytes:
    """The exposition text for ``engine``'s current state."""
    return generate_latest(engine.stats.registry)


async def metrics(request: web.Request) -> web.Response:
    body = render(request.app[STATE].engine)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
