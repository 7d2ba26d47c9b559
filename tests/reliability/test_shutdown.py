"""SIGTERM under load: a ``paged-serve`` process with ten streams (and a plain request) in flight
stops accepting connections, ends every stream with a final frame, answers the plain request
with 503, and exits 0 well within 20 s."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import aiohttp
import pytest

from tests.reliability.conftest import PATHS, assert_no_leak, parse_sse
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess

NUM_STREAMS = 10
LONG = 200  # tokens each would run for (~30 s or more here) if nobody stopped them
EXIT_DEADLINE_S = 20.0


def _long_body(path: str, stream: bool = True) -> dict:
    if path == "responses":
        return {"input": "Tell me a long story.", "max_output_tokens": LONG, "stream": stream}
    body = {"max_tokens": LONG, "ignore_eos": True, "stream": stream}
    if path == "chat/completions":
        return {**body, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return {**body, "prompt": "Once upon a time"}


async def _first_text(resp: aiohttp.ClientResponse) -> bytes:
    """Read up to the first frame carrying generated text; returns what was read."""
    seen = b""
    while True:
        line = await resp.content.readline()
        assert line, "the stream ended before any text"
        seen += line
        if re.search(rb'"(text|content|delta)":"[^"]', line):
            return seen


async def _sigterm_under_load(server: ServerProcess, url: str) -> dict:
    paths = [PATHS[i % len(PATHS)] for i in range(NUM_STREAMS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        streams = [await session.post(f"{url}/v1/{p}", json=_long_body(p)) for p in paths]
        plain = asyncio.create_task(
            session.post(f"{url}/v1/completions", json=_long_body("completions", stream=False))
        )
        heads = [await _first_text(resp) for resp in streams]  # all ten are generating
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        first_rest = await streams[0].read()
        # The listening socket closes before the streams are ended: no new connection now.
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{url}/health")
        rests = [first_rest] + [await resp.read() for resp in streams[1:]]
        plain_resp = await plain
        plain_status, plain_body = plain_resp.status, await plain_resp.read()
        exit_code = await asyncio.to_thread(server.proc.wait, EXIT_DEADLINE_S)
        exited_after = time.monotonic() - sent
    return {
        "paths": paths,
        "bodies": [head + rest for head, rest in zip(heads, rests)],
        "plain": (plain_status, plain_body),
        "exit_code": exit_code,
        "exited_after": exited_after,
    }


def test_sigterm_with_streams_in_flight():
    server = ServerProcess(
        ["--port", "0", "--kv-cache-memory", str(32 << 20), "--max-model-len", "512"]
    )
    try:
        ready = server.wait_for(READY, START_DEADLINE_S)
        url = ready.group("url")
        assert url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
        outcome = asyncio.run(_sigterm_under_load(server, url))
    finally:
        server.stop()
    assert outcome["exit_code"] == 0
    assert outcome["exited_after"] < EXIT_DEADLINE_S
    for path, body in zip(outcome["paths"], outcome["bodies"]):
        assert_no_leak(body)
        frames = parse_sse(body)
        if path == "responses":
            event, data = frames[-1]
            error = json.loads(data)
            assert event == "error"
        else:
            assert frames[-1] == (None, "[DONE]")
            error = json.loads(frames[-2][1])["error"]
        assert error["code"] == "request_aborted"
        assert "shutting down" in error["message"]
        assert len(frames) < LONG  # stopped, not run to the end
    status, body = outcome["plain"]
    assert status == 503
    assert json.loads(body)["error"]["code"] == "request_aborted"
    server.wait_for(re.compile(rf"aborting {NUM_STREAMS + 1} request\(s\) in flight"), 5.0)
    server.wait_for(re.compile("stopped"), 5.0)
