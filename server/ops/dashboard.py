"""The dashboard: a live page of the paged KV cache at work, and a chat playground.

Routes (added by ``create_app`` unless ``dashboard=False``, the CLI's ``--no-dashboard``)::

    GET /, GET /dashboard     the page: server/ops/static/dashboard.html, self-contained (inline CSS
                              and JavaScript, no CDN; its Content-Security-Policy lets it
                              fetch from this server only)
    GET /v1/engine/state      the engine's state as JSON (docs/api.md), behind the API keys
                              like every /v1 route

The page polls the state endpoint a few times a second while it is visible. The endpoint's
engine part is taken between steps, only while someone asks, at most every
``paged_serve.engine.observe.engine_state.MIN_INTERVAL_S`` (see that module); its history part is
sampled here once a second from the counters /metrics reads, so the charts cover the last minutes
even when nobody was watching. The page is served wherever the API is: there is no other listener,
and a server on loopback (the default) serves it on loopback only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.observe.metrics import histogram_sum_count
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError
from paged_serve.server.protocol.ops import EngineStateReply, HistoryPoint
from paged_serve.server.state import STATE

PAGE_FILE = Path(__file__).with_name("static") / "dashboard.html"
HISTORY_INTERVAL_S = 1.0
HISTORY_POINTS = 300  # five minutes
FIRST_STATE_WAIT_S = 5.0  # a first state comes after the engine's current step
PAGE_HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # Inline script and style only; every fetch goes to this server; no framing.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
}


class History:
    """The last ``HISTORY_POINTS`` seconds of counters, turned into per-interval rates."""

    def __init__(self, maxlen: int = HISTORY_POINTS) -> None:
        self.points: deque[HistoryPoint] = deque(maxlen=maxlen)
        self._last: tuple[float, int, int, float, int, int] | None = None

    def sample(self, engine: AsyncEngine, now: float | None = None) -> None:
        """Read the engine's counters (never waits for a step) and add a point; ``now`` is
        ``time.monotonic()`` seconds (by default, the current time)."""
        now = time.monotonic() if now is None else now
        snap = engine.snapshot()
        stats = engine.stats
        ttft_sum, ttft_count = histogram_sum_count(stats.ttft)
        counters = (
            now,
            stats.generation_tokens_total,
            stats.prompt_tokens_total,
            ttft_sum,
            ttft_count,
            snap.num_preemptions,
        )
        last, self._last = self._last, counters
        if last is None:
            return
        dt = now - last[0]
        ttft_n = ttft_count - last[4]
        self.points.append(
            HistoryPoint(
                time=round(time.time(), 3),
                generation_tokens_per_s=round((counters[1] - last[1]) / dt, 2),
                prompt_tokens_per_s=round((counters[2] - last[2]) / dt, 2),
                ttft_s=round((ttft_sum - last[3]) / ttft_n, 4) if ttft_n else None,
                requests_running=snap.num_running,
                requests_waiting=snap.num_waiting,
                kv_blocks_used=snap.kv_blocks_used,
                preemptions=snap.num_preemptions - last[5],
            )
        )


HISTORY = web.AppKey("paged_serve_history", History)


async def page(request: web.Request) -> web.Response:
    return web.Response(body=request.app[PAGE], headers=PAGE_HEADERS)


async def engine_state(request: web.Request) -> web.Response:
    server = request.app[STATE]
    engine = server.engine
    state = engine.engine_state()
    deadline = time.monotonic() + FIRST_STATE_WAIT_S
    while state is None:  # the first ever request, while the engine is in a step
        if time.monotonic() > deadline:
            raise APIError(
                503,
                "the engine has not finished a step yet; retry",
                type=SERVER_ERROR,
                code="engine_busy",
            )
        await asyncio.sleep(0.02)
        state = engine.engine_state()
    reply = EngineStateReply(
        model=server.served_model_name,
        weights=engine.weights,
        history_interval_s=HISTORY_INTERVAL_S,
        engine=state,
        history=list(request.app[HISTORY].points),
    )
    return web.Response(
        body=msgspec.json.encode(reply),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def _sample_history(app: web.Application) -> AsyncIterator[None]:
    """A task that samples the history every second while the app runs."""
    engine = app[STATE].engine
    history = app[HISTORY]

    async def run() -> None:
        while True:
            history.sample(engine)
            await asyncio.sleep(HISTORY_INTERVAL_S)

    task = asyncio.get_running_loop().create_task(run())
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


PAGE = web.AppKey("paged_serve_dashboard_page", bytes)


def add_dashboard(app: web.Application) -> None:
    """Serve the page and the state endpoint from ``app`` (whose ``STATE`` is set)."""
    app[PAGE] = PAGE_FILE.read_bytes()
    app[HISTORY] = History()
    app.router.add_get("/", page)
    app.router.add_get("/dashboard", page)
    app.router.add_get("/v1/engine/state", engine_state)
    app.cleanup_ctx.append(_sample_history)
