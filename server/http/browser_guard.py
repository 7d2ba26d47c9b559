"""What keeps a web page from driving the API through its visitor's browser.

A server on 127.0.0.1 without ``--api-key`` serves whoever reaches it, and a browser reaches it
for every page it shows. Three checks, each answered with the OpenAI error object:

* **Host** (DNS rebinding). When the server listens on loopback only, a request's Host must
  name a loopback host - ``localhost``, ``*.localhost``, a loopback address (``127.0.0.0/8``,
  ``[::1]``), any port - or one of ``ServerLimits.allowed_hosts``. A page whose own name was
  made to resolve to 127.0.0.1 is, to its browser, same-origin with the server, but it still
  sends its own name as Host: 403 ``host_not_allowed``. A request without Host (HTTP/1.0, never
  a browser) passes.
* **Origin** (cross-site requests). A request other than GET, HEAD or OPTIONS whose Origin is
  not the server's own (scheme-default or same port, the Host header's name) nor on
  ``allowed_hosts`` gets 403 ``origin_not_allowed``. Browsers send Origin with every
  cross-origin POST and DELETE; other clients send none. The dashboard page calls the API
  from the server's own origin.
* **Content-Type** (the request a browser sends cross-site without asking first). A POST body
  is JSON: its Content-Type must be ``application/json`` or an ``application/*+json`` type
  (parameters such as ``charset`` allowed), ``application/octet-stream`` (what HTTP libraries
  send for raw bytes; no browser sends it cross-site without a CORS preflight, which this
  server never grants), or absent. Anything else - ``text/plain``,
  ``application/x-www-form-urlencoded``, ``multipart/form-data``, the three a cross-site form or
  ``fetch`` may send - gets 415 ``unsupported_media_type``. So does ``curl -d`` without
  ``-H 'Content-Type: application/json'``, which vLLM refuses too (FastAPI parses a body as
  JSON only with a JSON type or none).

``allowed_hosts`` holding ``"*"`` turns the Host and Origin checks off (behind a proxy that
rewrites Host, for one); the Content-Type check always holds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from yarl import URL

from paged_serve.server.http.connections import is_loopback_address
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.state import STATE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}
RAW_BODY_TYPE = "application/octet-stream"


@web.middleware
async def browser_guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what a web page could make a browser send (module docstring), before the API key
    is checked and the body read."""
    state = request.app[STATE]
    limits = state.limits
    host = request.headers.get(hdrs.HOST)
    if not limits.any_host:
        if host is not None and state.connections.listens_on_loopback():
            check_host(host, limits.allowed_hosts)
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and request.method not in SAFE_METHODS:
            check_origin(origin, host, limits.allowed_hosts)
    if request.method == hdrs.METH_POST and request.body_exists:
        check_content_type(request.headers.get(hdrs.CONTENT_TYPE))
    return await handler(request)


def split_host(value: str) -> tuple[str, int | None]:
    """A Host value's name (lowercase, no brackets, no trailing dot) and port:
    ``"[::1]:8000"`` -> ``("::1", 8000)``; ``ValueError`` if it is garbled."""
    value = value.strip()
    if value.startswith("["):
        name, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(value)
        port = rest[1:]
    else:
        name, _, port = value.partition(":")
    if port and not port.isdigit() or (not port and value.endswith(":")):
        raise ValueError(value)
    return name.lower().removesuffix("."), int(port) if port else None


def is_loopback_name(name: str) -> bool:
    """``localhost``, a ``*.localhost`` name (browsers resolve those to loopback themselves),
    or a loopback address."""
    return name == "localhost" or name.endswith(".localhost") or is_loopback_address(name)


def check_host(value: str, allowed: tuple[str, ...]) -> None:
    """403 unless the Host ``value`` names a loopback host or one of ``allowed``."""
    try:
        name, _ = split_host(value)
    except ValueError:
        name = ""
    if name and (is_loopback_name(name) or name in allowed):
        return
    raise APIError(
        403,
        f"the Host {value!r} is not a loopback name, and this server listens on loopback "
        "only: use localhost or 127.0.0.1 (a page whose name resolves here is refused), or "
        "start the server with --allowed-hosts naming the host",
        code="host_not_allowed",
    )


def check_origin(origin: str, host: str | None, allowed: tuple[str, ...]) -> None:
    """403 unless ``origin`` is the server's own (the Host's name and port) or on
    ``allowed``."""
    url = URL(origin)
    name = (url.host or "").lower().removesuffix(".")
    if url.scheme in DEFAULT_PORTS and name:
        if name in allowed or (host is not None and _same_origin(url, name, host)):
            return
    raise APIError(
        403,
        f"a request from the web page at {origin!r} is refused: a browser may not drive this "
        "API from another site; start the server with --allowed-hosts naming that host to "
        "trust it",
        code="origin_not_allowed",
    )


def _same_origin(url: URL, name: str, host: str) -> bool:
    try:
        host_name, host_port = split_host(host)
    except ValueError:
        return False
    default = DEFAULT_PORTS[url.scheme]
    return name == host_name and (url.explicit_port or default) == (host_port or default)


def check_content_type(value: str | None) -> None:
    """415 unless a POST body's Content-Type ``value`` is a JSON type, raw bytes or absent."""
    mime = (value or "").partition(";")[0].strip().lower()
    if not mime or mime == RAW_BODY_TYPE or is_json_type(mime):
        return
    raise APIError(
        415,
        f"the request body must be JSON sent as Content-Type: application/json, not {value!r}"
        " (curl: add -H 'Content-Type: application/json')",
        code="unsupported_media_type",
    )


def is_json_type(mime: str) -> bool:
    """``application/json`` or an ``application/*+json`` type (lowercase, no parameters)."""
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))
