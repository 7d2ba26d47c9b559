"""An image URL to its encoded bytes, within ``MediaConfig``.

- ``data:image/<format>;base64,<data>``: always; the base64 is decoded strictly.
- ``file://<path>``: only under ``--allowed-local-media-path``; the path is resolved (symlinks
  and ``..`` followed) before the check, and read in the decode pool.
- ``http(s)://``: only from a host of ``--allowed-media-domains`` (the host name, without
  port), fetched with aiohttp within ``fetch_timeout_s`` and ``max_bytes``; a redirect is
  followed only to the same host (up to ``max_redirects``), never to another.

Every refusal is a 400 naming the part (``param``) and why.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp

from paged_serve.server.media.config import MediaConfig
from paged_serve.server.protocol.errors import bad_request


async def image_bytes(url: str, config: MediaConfig, param: str) -> bytes:
    """The encoded image at ``url`` (400 naming ``param`` for a URL this server may not read,
    or a fetch that fails)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await asyncio.get_running_loop().run_in_executor(
            _pool(), data_url_bytes, url, config.max_bytes, param
        )
    if scheme == "file":
        return await asyncio.get_running_loop().run_in_executor(
            _pool(), file_url_bytes, url, config, param
        )
    if scheme in ("http", "https"):
        return await http_bytes(url, config, param)
    raise bad_request(f"image URLs must be data:, file: or http(s): URLs, got {url[:40]!r}", param)


def _pool():  # noqa: ANN202 - the decode pool (imported late: decode imports Pillow lazily)
    from paged_serve.server.media.decode import DECODE_POOL

    return DECODE_POOL


def data_url_bytes(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL."""
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.lower().startswith("image/") or ";base64" not in header.lower():
        raise bad_request("a data URL must read data:image/<format>;base64,<data>", param)
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise bad_request(f"the image is over {max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data URL's image is not valid base64", param) from None


def file_url_bytes(url: str, config: MediaConfig, param: str) -> bytes:
    """The file of a ``file://`` URL under ``config.local_path``."""
    if config.local_path is None:
        raise bad_request(
            "file: URLs are not allowed (the server runs without --allowed-local-media-path)",
            param,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"a file: URL names no host, got {parts.netloc!r}", param)
    root = config.local_path.resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise bad_request(f"{path} is outside --allowed-local-media-path {root}", param)
    try:
        size = path.stat().st_size
        if size > config.max_bytes:
            raise bad_request(f"the image is over {config.max_bytes} bytes", param)
        return path.read_bytes()
    except OSError as exc:
        raise bad_request(f"cannot read {path}: {exc.strerror}", param) from None


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


async def http_bytes(url: str, config: MediaConfig, param: str) -> bytes:
    """The body at an ``http(s)://`` URL of an allowed host."""
    host = _host(url)
    allowed = {d.lower() for d in config.domains}
    if host not in allowed:
        why = (
            f"the host {host!r} is not in --allowed-media-domains"
            if allowed
            else "http(s) image URLs are not allowed (the server runs without "
            "--allowed-media-domains)"
        )
        raise bad_request(why, param)
    try:
        return await asyncio.wait_for(_fetch(url, host, config, param), config.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise bad_request(
            f"fetching the image took over {config.fetch_timeout_s:g} s", param
        ) from None
    except aiohttp.ClientError as exc:
        raise bad_request(f"fetching the image failed: {exc}", param) from None


async def _fetch(url: str, host: str, config: MediaConfig, param: str) -> bytes:
    async with aiohttp.ClientSession() as session:
        for _ in range(config.max_redirects + 1):
            async with session.get(url, allow_redirects=False) as response:
                if response.status in (301, 302, 303, 307, 308):
                    target = urljoin(url, response.headers.get("Location", ""))
                    if _host(target) != host or urlsplit(target).scheme not in ("http", "https"):
                        raise bad_request(
                            f"the image URL redirects to another host ({_host(target)!r})", param
                        )
                    url = target
                    continue
                if response.status != 200:
                    raise bad_request(f"fetching the image answered HTTP {response.status}", param)
                if (response.content_length or 0) > config.max_bytes:
                    raise bad_request(f"the image is over {config.max_bytes} bytes", param)
                body = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > config.max_bytes:
                        raise bad_request(f"the image is over {config.max_bytes} bytes", param)
                return bytes(body)
    raise bad_request(f"the image URL redirects more than {config.max_redirects} times", param)
