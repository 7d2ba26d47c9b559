"""One engine on the default model and in-process servers for the whole session.

The servers (an open one and one that requires API keys, sharing the engine) run on free
127.0.0.1 ports from one event loop in a background thread, through the same ``make_runner``
the CLI uses. After every test that touched the engine, ``pool_clean`` waits (bounded) until no
request is live and checks the block pool's integrity and that no block is still used.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator

import aiohttp
import openai
import pytest
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.server.app import create_app, make_runner
from paged_serve.server.http.limits import ServerLimits

KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 64 << 10
MAX_STORED_RESPONSES = 8
API_KEYS = ("sk-alpha", "sk-beta")
IDLE_DEADLINE_S = 10.0


class ServerThread:
    """An event loop in a daemon thread that serves aiohttp apps on free ports."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server")
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def serve(self, make_app: Callable[[], web.Application]) -> str:
        """Start ``make_app()`` on a free port; its base URL (without /v1)."""

        async def start() -> int:
            runner = make_runner(make_app(), shutdown_timeout=5.0)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            return runner.addresses[0][1]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=30)
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="session")
def engine(default_model: LoadedModel) -> Iterator[AsyncEngine]:
    config = EngineConfig(kv_cache_memory=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(config, loaded=default_model)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server_thread() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def base_url(engine: AsyncEngine, server_thread: ServerThread) -> str:
    return server_thread.serve(
        lambda: create_app(
            engine,
            limits=ServerLimits(
                max_request_bytes=MAX_BODY_BYTES, max_stored_responses=MAX_STORED_RESPONSES
            ),
        )
    )


@pytest.fixture(scope="session")
def keyed_url(engine: AsyncEngine, server_thread: ServerThread) -> str:
    return server_thread.serve(lambda: create_app(engine, api_keys=API_KEYS))


@pytest.fixture(scope="session")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model_name(engine: AsyncEngine) -> str:
    return engine.model_name


def random_model(tokenizer, eos_token_ids: tuple[int, ...]) -> LoadedModel:
    """The tests' tiny random-weight Llama over the default model's vocabulary."""
    from tests.conftest import tiny_model

    model = tiny_model("llama", vocab_size=len(tokenizer))
    return LoadedModel(model, tokenizer, "random-llama", eos_token_ids, 1024, 0.0)


@pytest.fixture(scope="module")
def random_engine(default_model: LoadedModel) -> Iterator[AsyncEngine]:
    """An engine on ``random_model``, where nothing but a grammar keeps the output valid (and
    fast: 2 small layers)."""
    loaded = random_model(default_model.tokenizer, default_model.eos_token_ids)
    engine = AsyncEngine(EngineConfig(kv_cache_memory=16 << 20), loaded=loaded)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def random_client(random_engine: AsyncEngine, server_thread: ServerThread) -> openai.OpenAI:
    url = server_thread.serve(lambda: create_app(random_engine))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(engine: AsyncEngine, deadline_s: float = IDLE_DEADLINE_S) -> None:
    """Poll (bounded) until no request is live and no block is used."""
    end = time.monotonic() + deadline_s
    while True:
        snap = engine.snapshot()
        if snap.kv_blocks_used == 0 and snap.num_running == 0 and snap.num_waiting == 0:
            return
        if time.monotonic() > end:
            raise AssertionError(f"the engine is not idle after {deadline_s} s: {snap}")
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def pool_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        wait_idle(engine)
        engine.check_integrity()
        assert engine.snapshot().kv_blocks_used == 0


# ---------------------------------------------------------------- raw HTTP helpers
class Reply:
    """A raw HTTP reply: status, headers and body."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> dict:
        return json.loads(self.body)


def http(
    method: str,
    url: str,
    *,
    json: object = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    """One request with aiohttp (its own event loop); the whole body read."""

    async def go() -> Reply:
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, json=json, data=data, headers=headers) as resp:
                return Reply(resp.status, dict(resp.headers), await resp.read())

    return asyncio.run(go())


def assert_error(
    reply: Reply, status: int, *, param: str | None = None, code: str | None = None
) -> dict:
    """The reply is the OpenAI error object with ``status``; returns the inner object."""
    assert reply.status == status, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    expected_type = "server_error" if status >= 500 else "invalid_request_error"
    assert error["type"] == expected_type
    assert error["param"] == param
    assert error["code"] == code
    return error


_FRAME = re.compile(rb"(?:event: (?P<event>[^\n]*)\n)?data: (?P<data>[^\n]*)\n\n")


def parse_sse(body: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event, data) frames, checking nothing else is in between."""
    frames, pos = [], 0
    while pos < len(body):
        match = _FRAME.match(body, pos)
        assert match, f"not an SSE frame at byte {pos}: {body[pos : pos + 80]!r}"
        event = match.group("event")
        frames.append((event.decode() if event else None, match.group("data").decode()))
        pos = match.end()
    return frames


def metric_values(base_url: str) -> dict[str, float]:
    """The /metrics samples by name (label sets included in the name)."""
    reply = http("GET", f"{base_url}/metrics")
    assert reply.status == 200
    values = {}
    for line in reply.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
