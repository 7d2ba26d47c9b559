"""``GET /metrics``: the engine's gauges, counters and latency histograms in the Prometheus
text exposition format (version 0.0.4), each with HELP and TYPE lines.

``paged_serve_kv_blocks_used`` counts blocks held by live requests only; blocks that sit in the
prefix cache with no request holding them are ``paged_serve_kv_blocks_cached``.
"""

from __future__ import annotations

from aiohttp import web

from engine.async_engine import AsyncEngine
from engine.metrics import Histogram
from server.state import STATE

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "paged_serve_"


def _scalar(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    lines += [
        f"# HELP {PREFIX}{name} {help_text}",
        f"# TYPE {PREFIX}{name} {kind}",
        f"{PREFIX}{name} {value}",
    ]


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
    for bound, count in hist.cumulative():
        lines.append(f'{full}_bucket{{le="{bound}"}} {count}')
    lines += [f"{full}_sum {hist.total}", f"{full}_count {hist.count}"]


def render(engine: AsyncEngine) -> str:
    """The exposition text for ``engine``'s current state."""
    snap = engine.snapshot()
    stats = engine.stats
    lines: list[str] = []
    gauges = [
        ("requests_running", "Requests in the running batch.", snap.num_running),
        ("requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting),
        ("kv_blocks_total", "KV cache blocks in the pool.", snap.kv_blocks_total),
        ("kv_blocks_used", "KV cache blocks held by live requests.", snap.kv_blocks_used),
        (
            "kv_blocks_cached",
            "KV cache blocks held only by the prefix cache (reusable, evictable).",
            snap.kv_blocks_cached,
        ),
    ]
    for name, help_text, value in gauges:
        _scalar(lines, name, "gauge", help_text, value)
    counters = [
        (
            "prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache.",
            snap.prefix_hit_tokens,
        ),
        (
            "prefix_cache_query_tokens_total",
            "Prompt tokens looked up in the prefix cache.",
            snap.prefix_query_tokens,
        ),
        ("preemptions_total", "Requests preempted to free KV blocks.", snap.num_preemptions),
        ("steps_total", "Engine steps (batches run through the model).", snap.num_steps),
        (
            "decode_graph_steps_total",
            "Engine steps that replayed a captured decode CUDA graph.",
            snap.num_graph_steps,
        ),
        ("generation_tokens_total", "Tokens generated.", stats.generation_tokens_total),
        ("prompt_tokens_total", "Prompt tokens received.", stats.prompt_tokens_total),
    ]
    for name, help_text, value in counters:
        _scalar(lines, name, "counter", help_text, value)
    with stats.lock:
        _histogram(
            lines,
            "time_to_first_token_seconds",
            "Seconds from arrival to the first output token.",
            stats.ttft,
        )
        _histogram(
            lines,
            "time_per_output_token_seconds",
            "Mean seconds between output tokens after the first, per request.",
            stats.tpot,
        )
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    text = render(request.app[STATE].engine)
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})
