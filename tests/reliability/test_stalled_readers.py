"""Clients that stop reading their response (issue 31, item 9): a stream that falls more than
``max_unsent_bytes`` behind is cut and its requests aborted; a write that makes no progress
for ``write_timeout_s`` aborts the connection, stream or whole body; a client that reads slowly
but steadily gets everything.

The clients are raw sockets on 127.0.0.1 that send a request and then read nothing, with small
receive buffers; the servers' sockets get small send buffers too (``small_send_buffers``), else
the kernel alone would take in megabytes (2.8 MB here) before the server held anything. Each
test checks, while the silent client is still connected, that the server let go of the
connection, that the engine aborted the request mid-decode (not ran it to its end), and that the
KV pool is whole (``pool_clean``).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, limits_from_args, main
from paged_serve.server.http import connections
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.state import STATE, ServerState
from perf.serving.load_test import AbortRecorder
from tests.reliability.conftest import request, wait_engine_idle
from tests.server.conftest import ServerThread

BOUND_S = 30.0  # how long anything here may take
BUFFER_BYTES = 4096  # SO_SNDBUF of the server's sockets, SO_RCVBUF of the silent clients'
UNSENT_BOUND = 16 << 10
WRITE_TIMEOUT_S = 1.0
# Token ids whose echo with logprobs makes a first frame of ~130 KB: more than the kernel and
# the transport's 64 KiB high-water mark take, so the transport pauses at once.
LONG_PROMPT = [1000 + 7 * i for i in range(800)]


@pytest.fixture
def small_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection accepted during the test gets a ``BUFFER_BYTES`` send buffer."""
    real = connections._GuardedConnection.connection_made

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
        real(self, transport)

    monkeypatch.setattr(connections._GuardedConnection, "connection_made", connection_made)


@pytest.fixture
def aborts(engine: AsyncEngine) -> Iterator[AbortRecorder]:
    """The state each request was in when the engine aborted it."""
    recorder = AbortRecorder(engine.engine)
    yield recorder
    recorder.close()


def _serve(thread: ServerThread, engine: AsyncEngine, **limits: object) -> tuple[str, ServerState]:
    """A server of its own for one test (so its guard's counters start at 0)."""
    app: web.Application = create_app(engine, limits=ServerLimits(**limits))
    return thread.serve(lambda: app), app[STATE]


@pytest.fixture
def unsent_bound(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    """Streams are cut at 16 KiB unsent; the write timeout is far beyond the tests."""
    return _serve(server_thread, engine, max_unsent_bytes=UNSENT_BOUND, write_timeout_s=120.0)


@pytest.fixture
def write_timeout(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    """A 1 s write timeout; the unsent bound is far beyond the tests."""
    return _serve(server_thread, engine, write_timeout_s=WRITE_TIMEOUT_S, max_unsent_bytes=64 << 20)


# ------------------------------------------------------------------------------ helpers
def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(data))
    )
    return head + data


def _connect(url: str, state: ServerState) -> socket.socket:
    """A connection with a small receive buffer (set before connecting, so the window the
    client offers stays small), once the server has admitted it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
    sock.settimeout(BOUND_S)
    sock.connect((host, int(port)))
    _wait_for(lambda: len(state.connections) == 1, "the server admitted the connection")
    return sock


def _wait_for(condition: Callable[[], bool], what: str) -> float:
    """Poll (bounded) until ``condition()``; seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > BOUND_S:
            raise AssertionError(f"not within {BOUND_S} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def _read_to_close(sock: socket.socket, *, chunk: int = 65536, pause_s: float = 0.0) -> bytes:
    """Everything until the server closes (a reset ends it too), ``chunk`` bytes per read
    with ``pause_s`` between reads."""
    answer = b""
    while True:
        try:
            data = sock.recv(chunk)
        except ConnectionResetError:
            return answer
        if not data:
            return answer
        answer += data
        time.sleep(pause_s)


def _let_go(state: ServerState) -> float:
    """Wait (bounded) until the server has closed every connection (the silent client's);
    seconds it took."""
    return _wait_for(lambda: len(state.connections) == 0, "the server let go of the connection")


# ------------------------------------------------------------------------------ the tests
def echo_stream(max_tokens: int) -> dict:
    """A greedy completions stream that echoes ``LONG_PROMPT`` with 5 logprobs a token: a lot
    of output per token, so a client that does not read falls behind fast."""
    return {
        "prompt": LONG_PROMPT,
        "echo": True,
        "logprobs": 5,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def test_a_stream_whose_client_stops_reading_is_cut_at_the_unsent_bound(
    engine: AsyncEngine, unsent_bound, small_send_buffers, aborts: AbortRecorder
):
    """Before: the engine generated all 256 tokens of every choice into memory, and the
    handler and its connection waited for the client forever."""
    url, state = unsent_bound
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 256,
        "ignore_eos": True,
        "n": 4,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 5,
        "stream": True,
    }
    with _connect(url, state) as silent:
        silent.sendall(_post("/v1/completions", body))
        _let_go(state)
        wait_engine_idle(engine)  # the client is still connected and has read nothing
        answer = _read_to_close(silent)
    assert aborts.states["decode"] == 4, (aborts.states, answer[:300])  # every choice
    assert state.connections.unsent_overflows == 1
    assert state.connections.write_timeouts == 0
    assert answer.startswith(b"HTTP/1.1 200") or answer == b"", answer[:200]
    assert b"[DONE]" not in answer  # cut, not finished
    ok = request("POST", f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status == 200, ok.body


def test_a_stream_nobody_reads_is_aborted_at_the_write_timeout(
    engine: AsyncEngine, write_timeout, small_send_buffers, aborts: AbortRecorder
):
    url, state = write_timeout
    body = echo_stream(max_tokens=200)
    with _connect(url, state) as silent:
        silent.sendall(_post("/v1/completions", body))
        _let_go(state)
        wait_engine_idle(engine)
        assert aborts.states["decode"] == 1, aborts.states
        assert state.connections.write_timeouts == 1
        assert state.connections.unsent_overflows == 0


def test_a_body_nobody_reads_is_dropped_at_the_write_timeout(
    engine: AsyncEngine, write_timeout, small_send_buffers
):
    """A whole reply of ~0.9 MB (prompt_logprobs 20 over 800 tokens) that the client never
    takes: the connection, and the body it held, go at the write timeout."""
    url, state = write_timeout
    body = {"prompt": LONG_PROMPT, "max_tokens": 1, "prompt_logprobs": 20}
    with _connect(url, state) as silent:
        silent.sendall(_post("/v1/completions", body))
        _let_go(state)
        assert state.connections.write_timeouts == 1
    ok = request("POST", f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status == 200, ok.body


def test_a_client_that_reads_slowly_but_steadily_gets_its_whole_stream(
    engine: AsyncEngine, write_timeout, small_send_buffers
):
    """~130 KB read at ~40 KB/s keeps the transport paused for seconds, longer than the 1 s
    write timeout, but every quarter of it the client takes some: nothing is cut."""
    url, state = write_timeout
    body = echo_stream(max_tokens=8)
    with _connect(url, state) as reader:
        reader.sendall(_post("/v1/completions", body))
        answer = _read_to_close(reader, chunk=8192, pause_s=0.2)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert answer.count(b'"finish_reason":"length"') == 1
    assert b"data: [DONE]" in answer
    assert state.connections.write_timeouts == 0


# ------------------------------------------------------------------------------ the flags
def test_the_flags_set_the_write_limits():
    args = build_parser().parse_args(["--write-timeout=2.5", "--max-unsent-bytes=65536"])
    limits = limits_from_args(args)
    assert (limits.write_timeout_s, limits.max_unsent_bytes) == (2.5, 65536)
    default = limits_from_args(build_parser().parse_args([]))
    assert (default.write_timeout_s, default.max_unsent_bytes) == (600.0, 4 << 20)


@pytest.mark.parametrize("flag, value", [("--write-timeout", "0"), ("--max-unsent-bytes", "0")])
def test_a_bad_write_limit_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        main([f"{flag}={value}"])  # refused before any model is loaded
    assert info.value.code == 2
    assert f"error: {flag} must be" in capsys.readouterr().err
