"""Security: loopback by default, the API key on every /v1 route (compared in constant time),
nothing internal in error bodies, bounded bodies and headers, stored responses private to the
key that stored them."""

from __future__ import annotations

import asyncio
import socket

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server import app as server_app
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser
from tests.reliability.conftest import (
    Reply,
    arequest,
    assert_error_object,
    assert_no_leak,
    check_success,
    post,
    request,
)
from tests.server.conftest import API_KEYS, MAX_BODY_BYTES

SOCKET_TIMEOUT_S = 30.0


def test_the_server_binds_to_loopback_by_default():
    assert build_parser().parse_args([]).host == "127.0.0.1"


def _v1_routes(engine: AsyncEngine) -> list[tuple[str, str]]:
    """Every (method, path) the app serves under /v1, placeholders filled in."""
    app = create_app(engine, api_keys=API_KEYS)
    routes = []
    for route in app.router.routes():
        path = route.resource.canonical
        if route.method != "HEAD" and path.startswith("/v1"):
            path = path.replace("{model}", engine.model_name).replace("{response_id}", "resp_x")
            routes.append((route.method, path))
    assert len(routes) >= 7
    return routes


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer",
        "Bearer ",
        "Bearer wrong",
        f"Bearer {API_KEYS[0].upper()}",
        f"Basic {API_KEYS[0]}",
        API_KEYS[0],
    ],
    ids=["missing", "empty", "blank", "wrong", "wrong-case", "not-bearer", "no-scheme"],
)
def test_every_v1_route_needs_a_key(keyed_url: str, engine: AsyncEngine, authorization: str | None):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in _v1_routes(engine):
        reply = request(method, f"{keyed_url}{path}", json={}, headers=headers)
        assert_error_object(reply, 401, code="invalid_api_key")


def test_a_right_key_passes_on_every_v1_route(keyed_url: str, engine: AsyncEngine):
    for key in API_KEYS:
        for method, path in _v1_routes(engine):
            reply = request(
                method, f"{keyed_url}{path}", json={}, headers={"Authorization": f"Bearer {key}"}
            )
            assert reply.status != 401  # 200, or 400/404 for the empty body and unknown id


def test_keys_are_compared_in_constant_time(keyed_url: str, monkeypatch: pytest.MonkeyPatch):
    """hmac.compare_digest against every configured key, whichever matches (no early exit)."""
    calls: list[tuple[str, str]] = []
    real = server_app.hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_app.hmac, "compare_digest", spy)
    for authorization in ("Bearer wrong", f"Bearer {API_KEYS[0]}", f"Bearer {API_KEYS[-1]}"):
        calls.clear()
        request("GET", f"{keyed_url}/v1/models", headers={"Authorization": authorization})
        assert len(calls) == len(API_KEYS)
        assert all(len(a) == len(b) == 64 for a, b in calls)  # SHA-256 digests, never raw keys


def test_health_and_metrics_need_no_key(keyed_url: str):
    assert request("GET", f"{keyed_url}/health").status == 200
    assert request("GET", f"{keyed_url}/metrics").status == 200


def test_stored_responses_are_private_to_their_key(keyed_url: str):
    alpha, beta = ({"Authorization": f"Bearer {key}"} for key in API_KEYS)
    body = {"input": "Hi", "max_output_tokens": 1, "store": True}
    made = post(keyed_url, "responses", body, headers=alpha)
    check_success("responses", body, made)
    rid = made.json()["id"]
    url = f"{keyed_url}/v1/responses/{rid}"
    assert request("GET", url, headers=alpha).json()["id"] == rid
    for method in ("GET", "DELETE"):
        assert_error_object(request(method, url, headers=beta), 404, code="response_not_found")
    follow = {"input": "And?", "max_output_tokens": 1, "previous_response_id": rid}
    assert_error_object(
        post(keyed_url, "responses", follow, headers=beta),
        404,
        param="previous_response_id",
        code="response_not_found",
    )
    assert_error_object(request("GET", url), 401, code="invalid_api_key")
    assert request("GET", url, headers=alpha).status == 200  # beta's DELETE did nothing
    assert request("DELETE", url, headers=alpha).status == 200


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v1/nothing", 404),
        ("PUT", "/v1/completions", 405),
        ("GET", "/../../etc/passwd", 404),
    ],
)
def test_routing_errors_are_error_objects(base_url: str, method: str, path: str, status: int):
    assert_error_object(request(method, f"{base_url}{path}"), status)


def _raw_http(url: str, payload: bytes) -> bytes:
    """Send raw bytes on a fresh loopback connection; everything the server answers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(payload)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _request_head(extra: bytes, target: bytes = b"/health") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"Connection: close\r\n\r\n"


@pytest.mark.parametrize(
    "payload",
    [
        _request_head(b"X-Big: " + b"a" * 100_000 + b"\r\n"),  # one field over max_field_size
        _request_head(b"Authorization: Bearer " + b"k" * 20_000 + b"\r\n"),
        _request_head(b"".join(b"X-%d: a\r\n" % i for i in range(300))),  # over max_headers
        _request_head(b"", target=b"/" + b"a" * 20_000),  # request line over max_line_size
        b"NONSENSE\r\n\r\n",
    ],
    ids=["huge-field", "huge-authorization", "too-many-headers", "huge-request-line", "garbage"],
)
def test_oversized_or_garbled_heads_get_400_and_the_server_goes_on(base_url: str, payload: bytes):
    """aiohttp's parser refuses these before the app runs (max_line_size and max_field_size
    8190 bytes, max_headers 128): a plain-text 400 that leaks nothing."""
    answer = _raw_http(base_url, payload)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", answer[:200]
    assert_no_leak(body)
    assert request("GET", f"{base_url}/health").status == 200


def test_a_chunked_body_over_the_limit_is_413(base_url: str):
    """Without a Content-Length the limit still holds while the body streams in."""

    async def chunks():
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b"x" * 4096

    async def go() -> Reply:
        return await arequest("POST", f"{base_url}/v1/completions", data=chunks())

    assert_error_object(asyncio.run(go()), 413)
    body = {"prompt": "Hi", "max_tokens": 1}
    check_success("completions", body, post(base_url, "completions", body))
