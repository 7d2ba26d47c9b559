"""The routes routers call on a worker: /health_generate, /server_info, /model_info, /get_load,
/flush_cache and /reset_prefix_cache (server/ops/worker_api.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import openai
import pytest
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.ops.worker_api import HEALTH_PROBE
from paged_serve.server.state import ServerState
from tests.server.conftest import (
    API_KEYS,
    ServerThread,
    assert_error,
    http,
    metric_values,
    wait_idle,
)

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # several full KV blocks
CACHED = "paged_serve_kv_blocks_cached"


def _cached_tokens(client: openai.OpenAI, model: str) -> int:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_gives_the_serving_limits(path: str, base_url: str, engine: AsyncEngine):
    info = http("GET", f"{base_url}{path}").json()
    config = engine.config
    assert info["served_model_name"] == engine.model_name
    assert info["model_path"] == info["tokenizer_path"] == engine.model_name  # the default model
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["max_total_tokens"] == engine.snapshot().kv_blocks_total * engine.block_size
    assert info["max_running_requests"] == config.max_num_seqs
    assert info["max_prefill_tokens"] == config.max_num_batched_tokens
    assert info["page_size"] == engine.block_size == 16
    assert info["enable_prefix_caching"] is True
    assert isinstance(info["version"], str) and info["version"]


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_names_the_model(path: str, base_url: str, engine: AsyncEngine):
    info = http("GET", f"{base_url}{path}").json()
    assert info["is_generation"] is True
    assert info["model_type"] == engine.model_config.model_type == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["served_model_name"] == info["model_path"] == engine.model_name


def test_get_load_counts_live_requests_and_their_kv_tokens(
    base_url: str, client: openai.OpenAI, model_name: str
):
    assert http("GET", f"{base_url}/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=200, stream=True, temperature=0
    )
    try:
        next(iter(stream))  # the request has been prefilled
        [load] = http("GET", f"{base_url}/get_load").json()
        assert load["dp_rank"] == 0 and load["num_reqs"] == 1
        assert load["num_waiting_reqs"] == 0
        assert load["num_tokens"] >= 16 * 6  # its prompt's blocks at least
        assert load["num_tokens"] % 16 == 0
    finally:
        stream.close()


def test_health_generate_runs_one_token(base_url: str, engine: AsyncEngine):
    before = engine.stats.generation_tokens_total
    reply = http("GET", f"{base_url}/health_generate")
    assert reply.status == 200 and reply.body == b""
    assert engine.stats.generation_tokens_total == before + 1


def test_flush_cache_evicts_prefixes_and_refuses_while_busy(
    base_url: str, client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    _cached_tokens(client, model_name)
    assert _cached_tokens(client, model_name) > 0  # the prompt's blocks were cached
    wait_idle(engine)
    cached = metric_values(base_url)[CACHED]
    assert cached > 0

    stream = client.completions.create(
        model=model_name, prompt="Count to fifty:", max_tokens=200, stream=True
    )
    try:
        next(iter(stream))
        assert_error(http("POST", f"{base_url}/flush_cache"), 400, code="server_busy")
    finally:
        stream.close()
    wait_idle(engine)
    assert _cached_tokens(client, model_name) > 0  # nothing was evicted

    wait_idle(engine)
    with engine.between_steps() as idle:
        cached_now = idle.block_manager.num_cached_blocks  # what the flush must evict
    assert cached_now > 0
    reply = http("POST", f"{base_url}/flush_cache")
    assert reply.status == 200
    body = reply.json()
    assert body == {"message": "Cache flushed.", "evicted_blocks": cached_now}
    # The gauge is read from the engine's state snapshot, which may predate the flush by a moment.
    deadline = time.monotonic() + 5.0
    while metric_values(base_url)[CACHED] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_values(base_url)[CACHED] == 0
    assert _cached_tokens(client, model_name) == 0  # computed again
    wait_idle(engine)
    assert http("POST", f"{base_url}/reset_prefix_cache").json()["evicted_blocks"] > 0
    assert _cached_tokens(client, model_name) == 0


def test_cache_and_generating_routes_need_the_key_and_info_routes_do_not(keyed_url: str):
    assert_error(http("POST", f"{keyed_url}/flush_cache"), 401, code="invalid_api_key")
    assert_error(http("POST", f"{keyed_url}/reset_prefix_cache"), 401, code="invalid_api_key")
    assert_error(http("GET", f"{keyed_url}/health_generate"), 401, code="invalid_api_key")
    keyed = {"Authorization": f"Bearer {API_KEYS[1]}"}
    assert http("POST", f"{keyed_url}/flush_cache", headers=keyed).status == 200
    assert http("GET", f"{keyed_url}/health_generate", headers=keyed).status == 200
    for path in ("/server_info", "/model_info", "/get_load"):
        assert http("GET", f"{keyed_url}{path}").status == 200, path


def test_flush_cache_is_post_only(base_url: str):
    assert_error(http("GET", f"{base_url}/flush_cache"), 405)


HOLD_S = 3.0  # how long the gated step holds the engine thread (a long prefill)


class _LongStep:
    """Holds the engine thread inside its next step that has a request running (state lock
    held, as during a long prefill) until ``release``."""

    def __init__(self, engine: AsyncEngine):
        self._llm = engine.engine
        self._real = self._llm.step
        self.holding = threading.Event()
        self._release = threading.Event()
        self._llm.step = self._step

    def _step(self) -> list:
        outputs = self._real()
        if self._llm.num_running and not self.holding.is_set():
            self.holding.set()
            self._release.wait(60)
        return outputs

    def release(self) -> None:
        """Let the step return and unwrap ``step`` (idempotent)."""
        if not self._release.is_set():
            self._release.set()
            del self._llm.step


def test_a_flush_during_a_long_step_answers_at_once_and_health_stays_fast(
    base_url: str, engine: AsyncEngine
):
    async def scenario() -> tuple[float, float, int, float]:
        gate = _LongStep(engine)
        timeout = aiohttp.ClientTimeout(total=60)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "ignore_eos": True}
                async with session.post(f"{base_url}/v1/completions", json=body) as stream:
                    assert stream.status == 200
                    assert await asyncio.to_thread(gate.holding.wait, 30)
                    started = time.monotonic()

                    async def flush() -> tuple[int, float]:
                        async with session.post(f"{base_url}/flush_cache") as reply:
                            await reply.read()
                            return reply.status, time.monotonic() - started

                    async def poll_health() -> float:
                        slowest = 0.0
                        while time.monotonic() - started < HOLD_S:
                            asked = time.monotonic()
                            async with session.get(f"{base_url}/health") as reply:
                                assert reply.status == 200
                            slowest = max(slowest, time.monotonic() - asked)
                            await asyncio.sleep(0.05)
                        return slowest

                    (status, flushed_after), slowest = await asyncio.gather(flush(), poll_health())
                    held = time.monotonic() - started
                    gate.release()
                    await stream.read()  # the request runs to its end once the step returns
        finally:
            gate.release()
        return flushed_after, slowest, status, held

    flushed_after, slowest, status, held = asyncio.run(scenario())
    assert held >= HOLD_S
    assert status == 400  # busy: refused at once, not after the step
    assert flushed_after < HOLD_S / 3, flushed_after
    assert slowest < HOLD_S / 3, slowest
    wait_idle(engine)
    assert http("POST", f"{base_url}/flush_cache").status == 200  # idle: flushed


def test_concurrent_health_generate_callers_share_one_probe(
    engine: AsyncEngine, server_thread: ServerThread
):
    apps: list[web.Application] = []
    url = server_thread.serve(lambda: apps.append(create_app(engine)) or apps[-1])
    probe = apps[0][HEALTH_PROBE]
    arrived = 0
    real_wait = probe.wait

    async def counting_wait(state: ServerState) -> None:
        nonlocal arrived
        arrived += 1
        await real_wait(state)

    probe.wait = counting_wait
    callers = 20
    tokens_before = engine.stats.generation_tokens_total

    async def call_all() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def one() -> int:
                async with session.get(f"{url}/health_generate") as reply:
                    return reply.status

            return await asyncio.gather(*(one() for _ in range(callers)))

    with ThreadPoolExecutor(1) as pool:
        with engine.between_steps():  # the probe cannot finish before every caller is in
            statuses = pool.submit(asyncio.run, call_all())
            deadline = time.monotonic() + 30
            while arrived < callers and time.monotonic() < deadline:
                time.sleep(0.02)
        assert statuses.result(timeout=60) == [200] * callers
    assert probe.num_started == 1
    assert engine.stats.generation_tokens_total == tokens_before + 1


async def _post_completion(session: aiohttp.ClientSession, url: str) -> int:
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        await reply.read()
        return reply.status


async def _get_status(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url) as reply:
        await reply.read()
        return reply.status


async def _until_waiting(engine: AsyncEngine, count: int) -> None:
    """Until ``count`` requests wait (the inbox and the held step's arrivals included), within
    30 s."""
    deadline = time.monotonic() + 30
    while engine.snapshot().num_waiting < count:
        assert time.monotonic() < deadline, engine.snapshot()
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("probe_first", [True, False], ids=["not-counted", "not-refused"])
def test_health_probes_are_outside_max_waiting(
    probe_first: bool, base_url: str, engine: AsyncEngine
):
    """With ``--max-waiting 2`` and the engine held in a step: a waiting probe leaves both
    places to clients (probe first), and a full queue does not refuse the probe."""

    async def scenario() -> list[int]:
        gate = _LongStep(engine)
        timeout = aiohttp.ClientTimeout(total=120)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
                async with session.post(f"{base_url}/v1/completions", json=body) as running:
                    assert await asyncio.to_thread(gate.holding.wait, 30)
                    engine.max_waiting = 2
                    # the held step's own arrivals count as waiting in the snapshot until it ends
                    held = engine.snapshot().num_waiting
                    loop = asyncio.get_running_loop()
                    order = ["probe", "client", "client"]
                    started = []
                    for kind in order if probe_first else order[::-1]:
                        if kind == "probe":
                            call = _get_status(session, f"{base_url}/health_generate")
                        else:
                            call = _post_completion(session, base_url)
                        started.append(loop.create_task(call))
                        await _until_waiting(engine, held + len(started))
                    refused = await _post_completion(session, base_url)  # the queue is full
                    gate.release()
                    statuses = await asyncio.gather(*started)
                    await running.read()
        finally:
            engine.max_waiting = None
            gate.release()
        return [*statuses, refused]

    assert asyncio.run(scenario()) == [200, 200, 200, 503]
