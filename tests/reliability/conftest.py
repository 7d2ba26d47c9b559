"""Shared fixtures and checks for the reliability suite.

The session's default-model engine and its servers (open, and keyed) come from
``tests/server/conftest.py``; so does ``pool_clean``, which after every test that used
``engine`` waits (bounded) for it to go idle and checks its block pool. Tests that need another
engine configuration (a tiny KV pool, a waiting limit, a loop that will be killed) build one on
the same loaded model with ``serve_engine`` and stop it at the end.

Every reply is read with a timeout, so a hung server fails a test instead of hanging it, and
every error body is checked to be the OpenAI error object with no traceback or internal path in
it (``assert_error_object``); every 200 is checked to be a well-formed object or stream of the
endpoint (``check_success``), using the ``openai`` SDK's own types where they fit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

import paged_serve.server
from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.server.app import create_app, make_runner
from paged_serve.server.state import STATE, ServerState
from perf.serving.load_test import DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_NUM_BATCHED_TOKENS
from tests.server.conftest import (  # noqa: F401  (fixtures, re-registered for this folder)
    Reply,
    ServerThread,
    assert_error,
    base_url,
    engine,
    keyed_url,
    model_name,
    parse_sse,
    pool_clean,
    server_thread,
)

REQUEST_TIMEOUT_S = 60.0
IDLE_DEADLINE_S = 30.0
POLL_S = 0.02
# One 16-token KV block of the default model (fp32): 30 layers x 3 KV heads x 64 x 4 B x (K, V).
BLOCK_BYTES = 16 * 30 * 3 * 64 * 4 * 2
PATHS = ("completions", "chat/completions", "responses")
SERVER_ROOT = str(Path(paged_serve.server.__file__).resolve().parents[1])
# Text that must never reach a client: a traceback, or where the code lives.
LEAK_MARKERS = ("Traceback", 'File "', ".py", "/work/", SERVER_ROOT)


# ---------------------------------------------------------------------------- HTTP helpers
async def arequest(
    method: str,
    url: str,
    *,
    json: object = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Reply:
    """One request on a fresh session; the whole body read within ``timeout`` seconds."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.request(method, url, json=json, data=data, headers=headers) as resp:
            return Reply(resp.status, dict(resp.headers), await resp.read())


def request(method: str, url: str, **kwargs: object) -> Reply:
    """``arequest`` from synchronous code (its own event loop)."""
    return asyncio.run(arequest(method, url, **kwargs))


def post(base: str, path: str, body: object = None, **kwargs: object) -> Reply:
    """POST ``body`` (JSON) or ``data=`` (raw bytes) to ``{base}/v1/{path}``."""
    if "data" in kwargs:
        kwargs.setdefault("headers", {"Content-Type": "application/json"})
        return request("POST", f"{base}/v1/{path}", **kwargs)
    return request("POST", f"{base}/v1/{path}", json=body, **kwargs)


def assert_no_leak(body: bytes, sent: bytes = b"") -> None:
    """No traceback or internal path in ``body``, unless the client sent that text itself."""
    text = body.decode(errors="replace")
    for marker in LEAK_MARKERS:
        if marker not in sent.decode(errors="replace"):
            assert marker not in text, f"{marker!r} leaked to the client: {text[:300]}"


def assert_error_object(
    reply: Reply,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    sent: bytes = b"",
) -> dict:
    """``reply`` is the OpenAI error object with ``status``, ``param`` and ``code``, and leaks
    nothing; returns the inner object."""
    error = assert_error(reply, status, param=param, code=code)
    assert_no_leak(reply.body, sent)
    return error


def assert_well_formed_error(reply: Reply, sent: bytes = b"") -> dict:
    """Any 4xx/5xx: the error object's shape, whatever its param and code."""
    assert reply.headers["Content-Type"].startswith("application/json"), reply.body[:200]
    body = reply.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if reply.status >= 500 else "invalid_request_error")
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    assert_no_leak(reply.body, sent)
    return error


# ---------------------------------------------------------------------------- 200 checks
def _num_prompts(prompt: object) -> int:
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def expected_choices(path: str, body: dict) -> int:
    """How many choices a successful reply to ``body`` has."""
    n = body.get("n") or 1
    return _num_prompts(body["prompt"]) * n if path == "completions" else n


def _check_usage(usage: dict) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] >= 1


def check_success(path: str, body: dict, reply: Reply) -> None:
    """A 200 to ``body`` on ``/v1/{path}`` is a complete, well-formed object or stream."""
    assert reply.status == 200, reply.body[:300]
    if body.get("stream"):
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        frames = parse_sse(reply.body)
        if path == "responses":
            _check_responses_stream(body, frames)
        else:
            _check_chunk_stream(path, body, frames)
        return
    assert reply.headers["Content-Type"].startswith("application/json")
    data = reply.json()
    if path == "responses":
        response = Response.model_validate(data)
        assert response.status in ("completed", "incomplete")
        assert response.usage.output_tokens <= (body.get("max_output_tokens") or 1 << 30)
        return
    model = Completion if path == "completions" else ChatCompletion
    model.model_validate(data)
    choices = data["choices"]
    assert sorted(c["index"] for c in choices) == list(range(expected_choices(path, body)))
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    _check_usage(data["usage"])


def _check_chunk_stream(path: str, body: dict, frames: list[tuple[str | None, str]]) -> None:
    assert frames[-1] == (None, "[DONE]"), frames[-3:]
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    finished = []
    for chunk in chunks:
        if path == "chat/completions":
            ChatCompletionChunk.model_validate(chunk)
        else:
            assert chunk["object"] == "text_completion"
        finished += [c["index"] for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(expected_choices(path, body)))
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        assert chunks[-1]["choices"] == []
        _check_usage(chunks[-1]["usage"])


def _check_responses_stream(body: dict, frames: list[tuple[str | None, str]]) -> None:
    events = [json.loads(data) for _, data in frames]
    assert [e["type"] for e in events] == [event for event, _ in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    Response.model_validate(events[-1]["response"])


# ---------------------------------------------------------------------------- engines
def wait_engine_idle(eng: AsyncEngine, deadline_s: float = IDLE_DEADLINE_S) -> None:
    """Poll (bounded) until no request is live and no block is used."""
    end = time.monotonic() + deadline_s
    while True:
        snap = eng.snapshot()
        if snap.kv_blocks_used == 0 and snap.num_running == 0 and snap.num_waiting == 0:
            return
        if time.monotonic() > end:
            raise AssertionError(f"the engine is not idle after {deadline_s} s: {snap}")
        time.sleep(POLL_S)


def assert_pool_clean(eng: AsyncEngine) -> None:
    """Once idle: the block pool is consistent and no block is used."""
    wait_engine_idle(eng)
    eng.check_integrity()
    assert eng.snapshot().kv_blocks_used == 0


@dataclass
class LocalServer:
    """An engine of its own served by an in-process app."""

    engine: AsyncEngine
    url: str
    app: web.Application
    runner: web.AppRunner

    @property
    def state(self) -> ServerState:
        return self.app[STATE]


def serve_engine(
    thread: ServerThread,
    loaded: LoadedModel,
    *,
    max_waiting: int | None = None,
    app_kwargs: dict | None = None,
    **config: object,
) -> LocalServer:
    """A new engine on ``loaded`` with ``config``, served on a free 127.0.0.1 port."""
    eng = AsyncEngine(EngineConfig(**config), loaded=loaded, max_waiting=max_waiting)
    app = create_app(eng, **(app_kwargs or {}))

    async def start() -> tuple[web.AppRunner, int]:
        runner = make_runner(app, shutdown_timeout=5.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, runner.addresses[0][1]

    runner, port = asyncio.run_coroutine_threadsafe(start(), thread.loop).result(timeout=30)
    return LocalServer(eng, f"http://127.0.0.1:{port}", app, runner)


def stop_server(thread: ServerThread, local: LocalServer) -> None:
    asyncio.run_coroutine_threadsafe(local.runner.cleanup(), thread.loop).result(timeout=30)
    local.engine.shutdown()


@pytest.fixture(scope="session")
def tight(
    server_thread: ServerThread,  # noqa: F811  (the fixture imported above)
    default_model: LoadedModel,
) -> Iterator[LocalServer]:
    """The load test's server (``perf.serving.load_test``'s defaults): a KV pool of 40 blocks (640
    tokens), far too small for its load, so requests get preempted."""
    local = serve_engine(
        server_thread,
        default_model,
        kv_cache_memory=DEFAULT_KV_CACHE_BYTES,
        max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
    )
    yield local
    stop_server(server_thread, local)


@pytest.fixture(scope="session")
def small_pool(
    server_thread: ServerThread,  # noqa: F811  (the fixture imported above)
    default_model: LoadedModel,
) -> Iterator[LocalServer]:
    """A 12-block pool (192 tokens), prefill chunks of at most 32 tokens and no prefix cache,
    so tests can count blocks exactly."""
    local = serve_engine(
        server_thread,
        default_model,
        kv_cache_memory=12 * BLOCK_BYTES,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    yield local
    stop_server(server_thread, local)
