"""The tiny LLaVA of ``tests/vision_models.py`` served in-process (the session's
``ServerThread``) with a word-level chat template, and a loopback image host beside it: a PNG,
a redirect to another host name, a body over the byte cap and one slower than the fetch timeout.

After every test the engine must be idle with its block pool intact and no block used.
"""

from __future__ import annotations

import asyncio
import base64
import io
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.server.app import create_app
from paged_serve.server.media.config import MediaConfig
from tests.server.conftest import ServerThread, wait_idle
from tests.vision_models import llava, noise

# each message's text, then a generation prompt of one word: "w3\n<image> w1"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w1{% endif %}"
)
# a llava-hf-style template: content read as parts, the template writing each image's marker
PARTS_TEMPLATE = (
    "{% for m in messages %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
    "{% endfor %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}w2{% endif %}"
)
MAX_IMAGE_BYTES = 48 << 10
MAX_PIXELS = 200 * 200
FETCH_TIMEOUT_S = 0.5


def png(image) -> bytes:  # noqa: ANN001 - a PIL image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass(frozen=True)
class Vision:
    """The served LLaVA: its folder, the HF reference model, engine, base URL (without /v1),
    the folder file:// URLs may read, and the image host's base URL."""

    folder: Path
    model: object
    engine: AsyncEngine
    url: str
    media_dir: Path
    image_host: str


def _image_host(server_thread: ServerThread, image: bytes) -> str:
    port: list[int] = []

    async def image_png(request: web.Request) -> web.Response:
        return web.Response(body=image, content_type="image/png")

    async def elsewhere(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://localhost:{port[0]}/image.png")

    async def same_host(request: web.Request) -> web.Response:
        raise web.HTTPFound("/image.png")

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # no Content-Length: the cap holds while reading
        await response.prepare(request)
        for _ in range(MAX_IMAGE_BYTES // 4096 + 2):
            await response.write(b"\0" * 4096)
        return response

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(image[:32])
        await asyncio.sleep(FETCH_TIMEOUT_S * 4)
        return response

    def make() -> web.Application:
        app = web.Application()
        app.router.add_get("/image.png", image_png)
        app.router.add_get("/elsewhere", elsewhere)
        app.router.add_get("/same-host", same_host)
        app.router.add_get("/big", big)
        app.router.add_get("/slow", slow)
        return app

    async def start() -> int:  # a plain runner: make_runner wants a paged-serve app
        runner = web.AppRunner(make(), shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        server_thread.runners.append(runner)
        return runner.addresses[0][1]

    port.append(asyncio.run_coroutine_threadsafe(start(), server_thread.loop).result(timeout=30))
    return f"http://127.0.0.1:{port[0]}"


@pytest.fixture(scope="session")
def vision(
    tmp_path_factory: pytest.TempPathFactory, server_thread: ServerThread
) -> Iterator[Vision]:
    folder, model = llava(tmp_path_factory.mktemp("vision") / "llava")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    media_dir = tmp_path_factory.mktemp("media")
    (media_dir / "image.png").write_bytes(png(noise(7, 40, 40)))
    host = _image_host(server_thread, png(noise(8, 48, 32)))
    engine = AsyncEngine(
        EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    )
    media = MediaConfig(
        local_path=media_dir,
        domains=("127.0.0.1",),
        max_images=3,
        max_bytes=MAX_IMAGE_BYTES,
        fetch_timeout_s=FETCH_TIMEOUT_S,
        max_pixels=MAX_PIXELS,
    )
    url = server_thread.serve(
        lambda: create_app(engine, served_model_name="tiny-llava", media=media)
    )
    yield Vision(folder, model, engine, url, media_dir, host)
    engine.shutdown()


@pytest.fixture(scope="session")
def parts_template(vision: Vision, server_thread: ServerThread) -> Iterator[Vision]:
    """The same model with ``PARTS_TEMPLATE``, data: images only."""
    folder = vision.folder.parent / "llava-parts"
    shutil.copytree(vision.folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = PARTS_TEMPLATE
    tokenizer.save_pretrained(folder)
    engine = AsyncEngine(
        EngineConfig(model=str(folder), dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    )
    url = server_thread.serve(lambda: create_app(engine, served_model_name="tiny-llava"))
    yield Vision(folder, vision.model, engine, url, vision.media_dir, vision.image_host)
    engine.shutdown()


@pytest.fixture(autouse=True)
def pool_clean(request: pytest.FixtureRequest, vision: Vision) -> Iterator[None]:
    yield
    engines = [vision.engine]
    if "parts_template" in request.fixturenames:
        engines.append(request.getfixturevalue("parts_template").engine)
    for engine in engines:
        wait_idle(engine)
        engine.check_integrity()
        assert engine.snapshot().kv_blocks_used == 0
