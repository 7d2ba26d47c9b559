"""A headless Debian chromium driven over the DevTools protocol with aiohttp's websocket client.

No browser download and no new dependency: ``find_chromium()`` looks for the distribution's
``chromium`` (``apt-get install chromium``) and the tests skip when it is absent. The browser
resolves no name but 127.0.0.1 (``--host-resolver-rules``), keeps its profile in a temporary
folder, and everything it logs as an error (console errors, uncaught exceptions, failed loads)
is collected in ``Page.errors``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

START_DEADLINE_S = 30.0
COMMAND_DEADLINE_S = 30.0
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",  # CI runs as root, where the sandbox refuses to start
    "--disable-gpu",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


def find_chromium() -> str | None:
    """The path of Debian's chromium, or None."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    """One browser tab: send DevTools commands, evaluate JavaScript, wait for conditions."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._loaded = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self._on_event(data["method"], data.get("params", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the DevTools connection closed"))

    def _on_event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            texts = [str(a.get("value", a.get("description", ""))) for a in params["args"]]
            self.errors.append("console." + params["type"] + ": " + " ".join(texts))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"uncaught: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry['text']} {entry.get('url', '')}".strip())

    async def send(self, method: str, **params: Any) -> dict:
        """Run a DevTools command; its result (raises RuntimeError on a protocol error)."""
        command_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        await self.ws.send_str(json.dumps({"id": command_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, COMMAND_DEADLINE_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def goto(self, url: str) -> None:
        self._loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self._loaded.wait(), COMMAND_DEADLINE_S)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, deadline_s: float, poll_s: float = 0.05) -> Any:
        """Poll ``expression`` until it is truthy; its value (AssertionError after the deadline)."""
        end = time.monotonic() + deadline_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"{expression!r} still {value!r} after {deadline_s} s")
            await asyncio.sleep(poll_s)

    async def screenshot(self, path: Path) -> None:
        result = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(result["data"]))


@contextlib.asynccontextmanager
async def open_page(chromium: str, *, width: int = 1280, height: int = 900) -> AsyncIterator[Page]:
    """Start a headless chromium with a blank tab of ``width`` x ``height`` CSS pixels; stop it
    (and remove its profile) on exit."""
    # Chromium's helper processes may still be writing the profile as the folder goes.
    with tempfile.TemporaryDirectory(
        prefix="paged-serve-chromium-", ignore_cleanup_errors=True
    ) as profile:
        proc = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped with its helpers
        )
        try:
            port = await _devtools_port(Path(profile), proc)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    targets = await resp.json()
                [target] = [t for t in targets if t["type"] == "page"][:1]
                async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    page = Page(ws)
                    for domain in ("Page", "Runtime", "Log"):
                        await page.send(f"{domain}.enable")
                    await page.send(
                        "Emulation.setDeviceMetricsOverride",
                        width=width,
                        height=height,
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    yield page
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the chromium we started and the helpers in its process group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # helpers that outlived the browser
    except ProcessLookupError:
        pass
    proc.wait()


async def _devtools_port(profile: Path, proc: subprocess.Popen) -> int:
    """The port chromium chose, from the DevToolsActivePort file it writes at start."""
    active = profile / "DevToolsActivePort"
    end = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with code {proc.returncode} at start")
        if active.exists():
            first = active.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        await asyncio.sleep(0.05)
    raise RuntimeError(f"chromium did not open its DevTools port within {START_DEADLINE_S} s")
