"""A web page cannot drive the server through its visitor's browser (issue 31, item 10): a
Host that is not a loopback name is refused while the server listens on loopback (DNS
rebinding), a cross-site Origin is refused on POST and DELETE, and a body whose Content-Type is
one a cross-site form may send is refused with 415; every client that is not a browser page on
another site - the ``openai`` SDK, a JSON POST with or without a type, the dashboard's own
calls - is served as before.

The servers listen on 127.0.0.1; a client names any Host it likes, as a browser does for a page
whose name was made to resolve to 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import openai
import pytest
from aiohttp import web

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, limits_from_args, main
from paged_serve.server.http.connections import ConnectionGuard
from paged_serve.server.http.limits import ServerLimits
from tests.reliability.conftest import assert_error_object, check_success, request
from tests.server.conftest import ServerThread

BODY = {"prompt": "Hi", "max_tokens": 1}
DATA = json.dumps(BODY).encode()


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def _serve(thread: ServerThread, engine: AsyncEngine, **limits: object) -> str:
    app: web.Application = create_app(engine, limits=ServerLimits(**limits))
    return thread.serve(lambda: app)


@pytest.fixture(scope="module")
def trusting(engine: AsyncEngine, server_thread: ServerThread) -> str:
    """A loopback server that also answers to ``api.example`` (a proxy's public name)."""
    return _serve(server_thread, engine, allowed_hosts=("api.example",))


@pytest.fixture(scope="module")
def unchecked(engine: AsyncEngine, server_thread: ServerThread) -> str:
    return _serve(server_thread, engine, allowed_hosts=("*",))


# ------------------------------------------------------------------------------ Host
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/engine/state"),
        ("GET", "/"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
    ],
)
def test_a_rebound_host_is_refused(base_url: str, method: str, path: str):
    """A page at evil.example:<port> whose name now resolves to 127.0.0.1 is same-origin with
    the server to its browser, but sends its own name as Host."""
    headers = {"Host": f"evil.example:{_port(base_url)}"}
    body = BODY if method == "POST" else None
    reply = request(method, f"{base_url}{path}", json=body, headers=headers)
    assert_error_object(reply, 403, code="host_not_allowed")
    assert request("GET", f"{base_url}/health").status == 200


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:{port}",
        "LOCALHOST:{port}",
        "localhost.:{port}",
        "app.localhost:{port}",
        "127.0.0.1:{port}",
        "127.0.0.2",
        "[::1]:{port}",
        "[::ffff:127.0.0.1]:{port}",
    ],
)
def test_loopback_names_are_served(base_url: str, host: str):
    headers = {"Host": host.format(port=_port(base_url))}
    reply = request("POST", f"{base_url}/v1/completions", json=BODY, headers=headers)
    check_success("completions", BODY, reply)


@pytest.mark.parametrize(
    "host", [":{port}", "localhost.evil.example", "127.0.0.1.evil.example", "[::1", "10.0.0.1"]
)
def test_names_that_only_look_local_are_refused(base_url: str, host: str):
    headers = {"Host": host.format(port=_port(base_url))}
    reply = request("GET", f"{base_url}/v1/models", headers=headers)
    assert_error_object(reply, 403, code="host_not_allowed")


def test_allowed_hosts_extend_the_loopback_names(trusting: str):
    served = request("GET", f"{trusting}/v1/models", headers={"Host": "API.example:443"})
    assert served.status == 200, served.body
    refused = request("GET", f"{trusting}/v1/models", headers={"Host": "evil.example"})
    assert_error_object(refused, 403, code="host_not_allowed")


def test_a_star_turns_the_host_and_origin_checks_off(unchecked: str):
    headers = {"Host": "evil.example", "Origin": "http://evil.example"}
    reply = request("POST", f"{unchecked}/v1/completions", json=BODY, headers=headers)
    check_success("completions", BODY, reply)


@pytest.mark.parametrize(
    "addresses, loopback",
    [
        ([("127.0.0.1", 8000)], True),
        ([("::1", 8000, 0, 0)], True),
        ([("127.0.0.1", 8000), ("::1", 8000, 0, 0)], True),
        ([("0.0.0.0", 8000)], False),
        ([("::", 8000, 0, 0)], False),
        ([("127.0.0.1", 8000), ("192.168.1.5", 8000)], False),
        ([], False),
    ],
)
def test_the_host_check_holds_only_on_loopback_listeners(addresses: list, loopback: bool):
    """A server bound to another address (``--host 0.0.0.0``) is reached by whatever name its
    clients use, so its Host is not checked."""
    guard = ConnectionGuard(4)
    guard.runner = SimpleNamespace(addresses=addresses)
    assert guard.listens_on_loopback() is loopback


# ------------------------------------------------------------------------------ Origin
@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://localhost:3000", "http://127.0.0.1:1"]
)
def test_a_cross_site_post_is_refused(base_url: str, origin: str):
    headers = {"Origin": origin.format(port=_port(base_url))}
    reply = request("POST", f"{base_url}/v1/completions", json=BODY, headers=headers)
    assert_error_object(reply, 403, code="origin_not_allowed")


def test_a_cross_site_delete_is_refused(base_url: str):
    reply = request(
        "DELETE", f"{base_url}/v1/responses/resp_x", headers={"Origin": "http://evil.example"}
    )
    assert_error_object(reply, 403, code="origin_not_allowed")


def test_the_servers_own_origin_is_served(base_url: str):
    """The dashboard page's chat box posts from the server's own origin."""
    headers = {"Origin": f"http://127.0.0.1:{_port(base_url)}"}
    reply = request("POST", f"{base_url}/v1/completions", json=BODY, headers=headers)
    check_success("completions", BODY, reply)


def test_a_cross_site_get_is_not_refused(base_url: str):
    """A page elsewhere cannot read the answer (no CORS headers), and a GET changes nothing."""
    reply = request("GET", f"{base_url}/v1/models", headers={"Origin": "http://evil.example"})
    assert reply.status == 200


def test_an_allowed_host_is_a_trusted_origin(trusting: str):
    headers = {"Host": "127.0.0.1", "Origin": "https://api.example"}
    reply = request("POST", f"{trusting}/v1/completions", json=BODY, headers=headers)
    check_success("completions", BODY, reply)


# ------------------------------------------------------------------------------ Content-Type
@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",  # curl -d without -H
        "multipart/form-data; boundary=x",
        "application/xml",
    ],
)
def test_a_body_that_is_not_declared_json_gets_415(base_url: str, content_type: str):
    """What a cross-site form or fetch sends without a CORS preflight, with a JSON body."""
    reply = request(
        "POST", f"{base_url}/v1/completions", data=DATA, headers={"Content-Type": content_type}
    )
    assert_error_object(reply, 415, code="unsupported_media_type")


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.api+json",
        "application/octet-stream",
        "",
    ],
)
def test_a_json_body_is_served(base_url: str, content_type: str):
    reply = request(
        "POST", f"{base_url}/v1/completions", data=DATA, headers={"Content-Type": content_type}
    )
    check_success("completions", BODY, reply)


def test_a_body_without_a_content_type_is_served(base_url: str):
    """``requests.post(url, data=...)`` and ``http.client`` send none."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(DATA) + DATA)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_the_openai_sdk_is_served(base_url: str, model_name: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=model_name, prompt="Hi", max_tokens=1)
    assert completion.choices[0].finish_reason in ("stop", "length")
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------------------ the flag
def test_the_allowed_hosts_flag():
    args = build_parser().parse_args(["--allowed-hosts=api.example,[::1],Proxy.Example."])
    assert limits_from_args(args).allowed_hosts == ("api.example", "::1", "proxy.example")
    assert limits_from_args(build_parser().parse_args([])).allowed_hosts == ()


@pytest.mark.parametrize("value", ["api.example:8000", "http://api.example", "a b"])
def test_a_host_with_a_port_or_scheme_is_refused(value: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as info:
        main([f"--allowed-hosts={value}"])  # refused before any model is loaded
    assert info.value.code == 2
    assert "error: --allowed-hosts must be host names without a port" in capsys.readouterr().err
