"""Overload: a full waiting queue refuses at once (503), a full KV pool preempts (nobody fails,
nothing is lost), and a request that could never fit is refused at admission (400), not left
to hang."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from paged_serve.engine.model.loader import LoadedModel
from perf.serving.load_test import fetch_metrics, sse_events
from tests.reliability.conftest import (
    LocalServer,
    ServerThread,
    arequest,
    assert_error_object,
    assert_pool_clean,
    check_success,
    post,
    request,
    serve_engine,
    stop_server,
)

MAX_WAITING = 2
REFUSAL_DEADLINE_S = 5.0  # "at once": far below a single long request's run time
POLL_S = 0.02


@pytest.fixture(scope="module")
def one_at_a_time(server_thread: ServerThread, default_model: LoadedModel) -> Iterator[LocalServer]:
    """One running request at a time and at most MAX_WAITING waiting."""
    local = serve_engine(
        server_thread,
        default_model,
        max_waiting=MAX_WAITING,
        max_num_seqs=1,
        kv_cache_memory=16 << 20,
    )
    yield local
    stop_server(server_thread, local)


async def _first_frame(resp: aiohttp.ClientResponse) -> None:
    async for _ in sse_events(resp):
        return


async def _fill_the_queue_then_overflow(url: str) -> list[tuple[int, bytes, float]]:
    long = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        running = await session.post(f"{url}/v1/completions", json=long)
        await _first_frame(running)  # it runs, alone (max_num_seqs 1)
        waiting = [
            await session.post(f"{url}/v1/completions", json=long) for _ in range(MAX_WAITING)
        ]
        assert all(r.status == 200 for r in [running, *waiting])
        for _ in range(int(60 / POLL_S)):
            metrics = await fetch_metrics(session, url)
            if metrics["paged_serve_requests_waiting"] == MAX_WAITING:
                break
            await asyncio.sleep(POLL_S)
        assert metrics["paged_serve_requests_waiting"] == MAX_WAITING
        refused = []
        for path, body in [
            ("completions", {"prompt": "One more", "max_tokens": 2}),
            (
                "chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
            ),
            ("responses", {"input": "Hi", "max_output_tokens": 2}),
        ]:
            start = time.monotonic()
            reply = await arequest("POST", f"{url}/v1/{path}", json=body, timeout=30)
            refused.append((reply, time.monotonic() - start))
        for resp in [running, *waiting]:
            resp.close()  # hang up: everything is aborted
    return refused


def test_a_full_waiting_queue_refuses_at_once(one_at_a_time: LocalServer):
    refused = asyncio.run(_fill_the_queue_then_overflow(one_at_a_time.url))
    for reply, elapsed in refused:
        error = assert_error_object(reply, 503, code="queue_full")
        assert str(MAX_WAITING) in error["message"]
        assert elapsed < REFUSAL_DEADLINE_S
    assert_pool_clean(one_at_a_time.engine)
    body = {"prompt": "And now?", "max_tokens": 2}
    check_success("completions", body, post(one_at_a_time.url, "completions", body))


# 49, 53 and 46 tokens: 11 blocks once prefilled, 15 with their 20 output tokens each
PROMPTS = [
    "The river rose slowly through the spring, and the people of the valley watched it from "
    "the old stone bridge, wondering whether the fields by the water would flood again as "
    "they had in the year of the great storm, when the mill was lost.",
    "To bake a simple loaf of bread you need flour, water, salt and yeast. Mix them in a "
    "large bowl, knead the dough for ten minutes until it is smooth, then leave it to rise "
    "in a warm place for about an hour before shaping it.",
    "Dear friend, thank you for your kind letter and for the photographs of the garden. The "
    "roses look wonderful this year, and I was glad to hear that the apple tree you planted "
    "last autumn has finally started to grow new leaves.",
]
GREEDY = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}


async def _concurrently(url: str, prompts: list[str]) -> list[dict]:
    async def one(prompt: str) -> dict:
        reply = await arequest("POST", f"{url}/v1/completions", json={"prompt": prompt, **GREEDY})
        assert reply.status == 200, reply.body
        return reply.json()

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_a_full_kv_pool_preempts_and_loses_nothing(small_pool: LocalServer, base_url: str):
    """Three requests needing 15 blocks together in a 12-block pool, all at once: they take
    turns through preemption, and each ends with all its tokens, the very tokens it gets
    where there is room to spare (greedy)."""
    before = request("GET", f"{small_pool.url}/metrics").body
    squeezed = asyncio.run(_concurrently(small_pool.url, PROMPTS))
    preemptions = _preemptions(request("GET", f"{small_pool.url}/metrics").body)
    assert preemptions > _preemptions(before)
    roomy = asyncio.run(_concurrently(base_url, PROMPTS))
    for tight, loose in zip(squeezed, roomy):
        [choice] = tight["choices"]
        assert choice["finish_reason"] == "length"
        assert tight["usage"]["completion_tokens"] == GREEDY["max_tokens"]
        assert choice["text"] == loose["choices"][0]["text"]
    assert_pool_clean(small_pool.engine)


def _preemptions(metrics: bytes) -> float:
    for line in metrics.decode().splitlines():
        if line.startswith("paged_serve_preemptions_total "):
            return float(line.split()[1])
    raise AssertionError("no paged_serve_preemptions_total")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "Hi", "max_tokens": 192}, "prompt"),  # 1 + 192 tokens
        ("completions", {"prompt": [[5] * 100, [6] * 150], "max_tokens": 50}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi " * 200}]}, "messages"),
        ("responses", {"input": "Hi", "max_output_tokens": 190}, "input"),
    ],
)
def test_a_request_that_can_never_fit_is_refused_at_admission(
    small_pool: LocalServer, path: str, body: dict, param: str
):
    """The pool holds 192 tokens: asking for more is 400 at once, never a request that
    waits forever for blocks that cannot exist."""
    start = time.monotonic()
    reply = post(small_pool.url, path, body, timeout=30)
    assert time.monotonic() - start < REFUSAL_DEADLINE_S
    error = assert_error_object(reply, 400, param=param, code="context_length_exceeded")
    assert "192" in error["message"]
    models = json.loads(request("GET", f"{small_pool.url}/v1/models").body)
    assert models["data"][0]["max_model_len"] == 192  # what a client may ask for
    assert_pool_clean(small_pool.engine)
