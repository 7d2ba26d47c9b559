"""A client that goes away aborts its requests: their blocks return to the pool at once."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import metric_values, wait_idle

LONG = 256  # tokens a request would run for if nobody aborted it (~20 s on a CPU)
GENERATED = "paged_serve_generation_tokens_total"


async def _stream_then_drop(url: str, body: dict, frames: int) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=body)
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= frames:
                break
        resp.close()  # drop the connection mid-stream


async def _wait_then_drop(url: str, body: dict) -> None:
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(url, json=body) as resp:
                await resp.read()


def _assert_aborted(base_url: str, engine: AsyncEngine, before: float, n: int) -> None:
    at_drop = metric_values(base_url)[GENERATED]
    wait_idle(engine)
    engine.check_integrity()
    after = metric_values(base_url)
    assert after["paged_serve_kv_blocks_used"] == 0
    assert after["paged_serve_requests_running"] == 0
    assert after[GENERATED] - before < LONG * n / 2  # it did not run to the end
    assert after[GENERATED] - at_drop <= 4 * n  # freed within a step or so of the drop


@pytest.mark.parametrize(
    "path, body, n",
    [
        ("completions", {"prompt": "Once upon a time", "n": 2}, 2),
        ("chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}]}, 1),
        ("responses", {"input": "Tell a story"}, 1),
    ],
)
def test_streaming_client_disconnect_frees_blocks(
    base_url: str, engine: AsyncEngine, path: str, body: dict, n: int
):
    before = metric_values(base_url)[GENERATED]
    limit = "max_output_tokens" if path == "responses" else "max_tokens"
    body = {**body, limit: LONG, "stream": True, "temperature": 0}
    if path != "responses":
        body["ignore_eos"] = True
    asyncio.run(_stream_then_drop(f"{base_url}/v1/{path}", body, frames=3))
    _assert_aborted(base_url, engine, before, n)


def test_non_streaming_client_disconnect_frees_blocks(base_url: str, engine: AsyncEngine):
    before = metric_values(base_url)[GENERATED]
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True}
    asyncio.run(_wait_then_drop(f"{base_url}/v1/completions", body))
    _assert_aborted(base_url, engine, before, 1)
