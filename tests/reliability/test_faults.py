"""Fault isolation: a fault while processing one request fails that request alone; a dead engine
loop turns /health to 503 and ends every stream in flight with an error, none left hanging.

The per-request fault is injected in the detokenizer of requests whose prompt holds a marker,
after their second token (so a stream has already sent some text): the engine finishes that
request with ``finish_reason="error"`` and goes on with the others. The fault's message holds an
internal path, which must not reach the client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.sched.detokenizer import IncrementalDetokenizer
from perf.serving.load_test import fetch_metrics
from tests.reliability.conftest import (
    PATHS,
    LocalServer,
    Reply,
    ServerThread,
    arequest,
    assert_error_object,
    assert_no_leak,
    check_success,
    parse_sse,
    post,
    request,
    serve_engine,
    stop_server,
)

MARKER = "Zanzibar-quokka"
SECRET = "injected fault in /work/main/engine/secret.py"
FAULT_AFTER_TOKENS = 2
POLL_S = 0.02


@pytest.fixture
def faulty_detokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests whose prompt holds MARKER fail in their detokenizer at their third token."""
    real_init = IncrementalDetokenizer.__init__
    real_add = IncrementalDetokenizer.add_token

    def init(self, tokenizer, prompt_token_ids, **kwargs) -> None:
        real_init(self, tokenizer, prompt_token_ids, **kwargs)
        self.fault_countdown = None
        if tokenizer is not None and MARKER in tokenizer.decode(prompt_token_ids):
            self.fault_countdown = FAULT_AFTER_TOKENS

    def add_token(self, token_id: int) -> bool:
        if self.fault_countdown is not None:
            if self.fault_countdown == 0:
                raise RuntimeError(SECRET)
            self.fault_countdown -= 1
        return real_add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)


def _body(path: str, text: str, *, stream: bool, max_tokens: int = 8) -> dict:
    body: dict = {"stream": stream, "temperature": 0}
    if path == "responses":
        return {**body, "input": text, "max_output_tokens": max_tokens}
    body.update(max_tokens=max_tokens, ignore_eos=True)
    if path == "chat/completions":
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": text}


async def _both(url: str, path: str, stream: bool) -> tuple[Reply, Reply, dict]:
    faulty = _body(path, f"Tell me about {MARKER}.", stream=stream)
    healthy = _body(path, "Tell me about rivers.", stream=stream)
    bad, good = await asyncio.gather(
        arequest("POST", f"{url}/v1/{path}", json=faulty),
        arequest("POST", f"{url}/v1/{path}", json=healthy),
    )
    return bad, good, healthy


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", PATHS)
def test_a_fault_in_one_request_fails_it_alone(
    base_url: str, faulty_detokenizer: None, path: str, stream: bool
):
    bad, good, healthy = asyncio.run(_both(base_url, path, stream))
    check_success(path, healthy, good)  # served beside the faulty one, in the same batches
    if not stream:
        error = assert_error_object(bad, 500, code="generation_failed")
        assert "RuntimeError" in error["message"]
    else:
        assert bad.status == 200
        assert_no_leak(bad.body)
        frames = parse_sse(bad.body)
        if path == "responses":
            event, data = frames[-1]
            assert event == "error"
            assert json.loads(data)["code"] == "generation_failed"
            assert any(e == "response.output_text.delta" for e, _ in frames)
        else:
            assert frames[-1] == (None, "[DONE]")
            assert json.loads(frames[-2][1])["error"]["code"] == "generation_failed"
            choices = [c for _, d in frames[:-2] for c in json.loads(d)["choices"]]
            texts = [c.get("text") or c.get("delta", {}).get("content") for c in choices]
            assert any(texts), "the stream sent text before the fault"
    follow_up = _body(path, "And the sea?", stream=stream, max_tokens=2)
    check_success(path, follow_up, post(base_url, path, follow_up))


@pytest.fixture
def doomed(server_thread: ServerThread, default_model: LoadedModel) -> Iterator[LocalServer]:
    """A server of its own whose engine loop the test kills."""
    local = serve_engine(server_thread, default_model, kv_cache_memory=16 << 20)
    yield local
    stop_server(server_thread, local)


async def _until_text(path: str, resp: aiohttp.ClientResponse) -> None:
    """Read ``resp`` up to (and including) the first frame that carries generated text."""
    while True:
        line = await resp.content.readline()
        assert line, "the stream ended before any text"
        if not line.startswith(b"data: "):
            continue
        data = json.loads(line[len(b"data: ") :])
        if path == "responses":
            if data["type"] == "response.output_text.delta":
                return
        elif path == "chat/completions":
            if data["choices"] and data["choices"][0]["delta"].get("content"):
                return
        elif data["choices"] and data["choices"][0]["text"]:
            return


async def _kill_the_loop_mid_flight(local: LocalServer) -> tuple[list[bytes], Reply]:
    url = local.url
    streams = [_body(path, "Tell me a long story.", stream=True, max_tokens=200) for path in PATHS]
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        responses = [
            await session.post(f"{url}/v1/{path}", json=body) for path, body in zip(PATHS, streams)
        ]
        plain = asyncio.create_task(
            arequest(
                "POST",
                f"{url}/v1/completions",
                json=_body("completions", "Hi", stream=False, max_tokens=200),
            )
        )
        for path, resp in zip(PATHS, responses):
            assert resp.status == 200
            await _until_text(path, resp)
        for _ in range(int(30 / POLL_S)):
            running = (await fetch_metrics(session, url))["paged_serve_requests_running"]
            if running == 4:
                break
            await asyncio.sleep(POLL_S)
        assert running == 4  # the three streams and the plain request are all in the engine

        def crash() -> list:
            raise RuntimeError("simulated device failure in /work/main/engine/model_runner.py")

        local.engine.engine.step = crash
        rests = [await resp.read() for resp in responses]  # each ends: no hang
        return rests, await plain


def test_a_dead_engine_loop_ends_every_stream_and_turns_health_503(doomed: LocalServer):
    rests, plain = asyncio.run(_kill_the_loop_mid_flight(doomed))
    assert not doomed.engine.is_alive
    for path, rest in zip(PATHS, rests):
        assert_no_leak(rest)
        frames = parse_sse(rest.lstrip(b"\n"))  # the rest, after the frame already read
        if path == "responses":
            event, data = frames[-1]
            assert event == "error" and json.loads(data)["code"] == "engine_dead"
        else:
            assert frames[-1] == (None, "[DONE]")
            assert json.loads(frames[-2][1])["error"]["code"] == "engine_dead"
    assert_error_object(plain, 503, code="engine_dead")
    assert_error_object(request("GET", f"{doomed.url}/health"), 503, code="engine_dead")
    for path in PATHS:
        reply = post(doomed.url, path, _body(path, "Anyone?", stream=True, max_tokens=2))
        assert_error_object(reply, 503, code="engine_dead")


def test_the_shared_engine_is_alive(engine: AsyncEngine, base_url: str):
    """The destructive test above had its own engine: this one still serves."""
    assert engine.is_alive
    assert request("GET", f"{base_url}/health").status == 200
