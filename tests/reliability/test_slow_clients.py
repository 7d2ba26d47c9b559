"""Slow and idle clients, with raw sockets on 127.0.0.1: a head trickled byte by byte is cut
off at the header timeout, a body trickled slowly gets 408, and connections beyond
``max_connections`` never lock out a normal client nor a running request.

The servers here share the session's engine and are served through ``make_runner``, as the CLI
serves its app, with limits short enough to keep each test to a few seconds. Bounds are
generous: a test checks what happened within them, not how fast.
"""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.state import STATE, ServerState
from tests.reliability.conftest import assert_no_leak, request
from tests.server.conftest import ServerThread

TIMEOUT_S = 1.0  # the test servers' header and body timeouts
BOUND_S = 15.0  # how long anything here may take
CAP = 4
# a request head that never ends (no blank line), sent one byte at a time
ENDLESS_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000


@pytest.fixture(scope="module")
def short_timeouts(engine: AsyncEngine, server_thread: ServerThread) -> str:
    limits = ServerLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    return server_thread.serve(lambda: create_app(engine, limits=limits))


def _serve_capped(engine: AsyncEngine, thread: ServerThread, cap: int) -> tuple[str, ServerState]:
    """A server with ``cap`` connections and timeouts far beyond the tests (so what closes a
    connection is the cap, never a timeout)."""
    app = create_app(engine, limits=ServerLimits(max_connections=cap, header_timeout_s=120.0))
    return thread.serve(lambda: app), app[STATE]


@pytest.fixture(scope="module")
def capped(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    return _serve_capped(engine, server_thread, CAP)


@pytest.fixture(scope="module")
def single(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    return _serve_capped(engine, server_thread, 1)


# ------------------------------------------------------------------------------ raw sockets
def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=BOUND_S)


def _read_some(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the server sent within ``wait_s`` (b"" once it closed), None if nothing came."""
    readable, _, _ = select.select([sock], [], [], wait_s)
    if not readable:
        return None
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def _trickle(sock: socket.socket, data: bytes, interval_s: float) -> tuple[bytes, bool]:
    """Send ``data`` one byte every ``interval_s`` until the server answers or closes (or all
    is sent); what it answered, and whether it closed."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return b"", True
        answer = _read_some(sock, interval_s)
        if answer is not None:
            return answer, answer == b""
    return b"", False


def _is_closed(sock: socket.socket, wait_s: float) -> bool:
    return _read_some(sock, wait_s) == b""


def _read_to_close(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def _stream_request(max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    return head + body


def _start_stream(url: str, max_tokens: int) -> tuple[socket.socket, bytes]:
    """A streaming completion on a raw connection, read up to its first token's frame."""
    sock = _connect(url)
    sock.sendall(_stream_request(max_tokens))
    seen = b""
    while b'"text"' not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    return sock, seen


def _assert_whole_stream(answer: bytes, max_tokens: int) -> None:
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"data: [DONE]" in answer
    assert answer.count(b'"finish_reason":"length"') == 1
    assert b'"completion_tokens":%d' % max_tokens in answer


# ------------------------------------------------------------------------------ timeouts
def test_a_head_sent_one_byte_at_a_time_is_cut_off(short_timeouts: str):
    """aiohttp's default let such a connection live for an hour (3630 s)."""
    with _connect(short_timeouts) as sock:
        start = time.monotonic()
        answer, closed = _trickle(sock, ENDLESS_HEAD, 0.05)
        took = time.monotonic() - start
    assert closed and answer == b"", answer[:200]
    assert took < BOUND_S
    assert request("GET", f"{short_timeouts}/health").status == 200


def test_a_connection_that_sends_nothing_is_closed(short_timeouts: str):
    with _connect(short_timeouts) as sock:
        assert _is_closed(sock, BOUND_S)


def test_a_body_trickled_slowly_gets_408(short_timeouts: str):
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with _connect(short_timeouts) as sock:
        sock.sendall(head)
        answer, _ = _trickle(sock, body, 0.1)  # 4 s for the body, 1 s allowed
        # the whole answer (the error object is small, but may come in two reads)
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = _read_some(sock, BOUND_S)
            assert more, answer
            answer += more
    head_out, _, payload = answer.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"connection: close" in head_out.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert_no_leak(payload)
    ok = request("POST", f"{short_timeouts}/v1/completions", json=json.loads(body))
    assert ok.status == 200


# ------------------------------------------------------------------------------ the cap
def test_idle_connections_beyond_the_cap_do_not_lock_out_a_client(capped):
    """Twice the cap in slowloris connections: the oldest are closed as new ones come, so a
    normal client is answered at once; never more than the cap are open."""
    url, state = capped
    slow = []
    try:
        for _ in range(2 * CAP):
            sock = _connect(url)
            sock.sendall(ENDLESS_HEAD[:40])
            slow.append(sock)
            # admitted in order (so the oldest are the ones closed)
            deadline = time.monotonic() + BOUND_S
            while len(state.connections) < min(len(slow), CAP) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [_is_closed(s, 2.0) for s in slow[:CAP]] == [True] * CAP
        assert not any(_is_closed(s, 0.1) for s in slow[CAP:])
        assert len(state.connections) <= CAP
        start = time.monotonic()
        assert request("GET", f"{url}/health", timeout=BOUND_S).status == 200
        assert time.monotonic() - start < BOUND_S
        assert _is_closed(slow[CAP], 2.0)  # the longest idle made room for it
        assert state.connections.refused == 0
    finally:
        for sock in slow:
            sock.close()


def test_a_running_request_keeps_its_slot(capped):
    """A stream in flight is never the one closed to make room."""
    url, _ = capped
    stream, seen = _start_stream(url, max_tokens=24)
    slow = []
    try:
        for _ in range(2 * CAP):
            sock = _connect(url)
            sock.sendall(ENDLESS_HEAD[:40])
            slow.append(sock)
        with stream:
            _assert_whole_stream(seen + _read_to_close(stream), 24)
        assert sum(_is_closed(s, 2.0) for s in slow) >= len(slow) - (CAP - 1)
    finally:
        for sock in slow:
            sock.close()


def test_with_every_slot_running_a_newcomer_gets_503(single):
    url, state = single
    stream, seen = _start_stream(url, max_tokens=48)
    with stream:
        with _connect(url) as probe:
            answer = _read_to_close(probe)
        _assert_whole_stream(seen + _read_to_close(stream), 48)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer[:300]
    error = json.loads(payload)["error"]
    assert error["code"] == "too_many_connections" and error["type"] == "server_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert state.connections.refused >= 1
    # the slot is free again once the stream is done
    assert request("GET", f"{url}/health", timeout=BOUND_S).status == 200
