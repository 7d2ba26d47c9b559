"""The dashboard in a real headless browser: Debian's chromium over the DevTools protocol,
against the session's server on 127.0.0.1 (skipped where chromium is not installed).

One bounded scenario: the page loads and goes live with no console error; while a forked
request runs it shows blocks in use, shared blocks and the request; the playground streams a
reply and marks the visitor's own request; after the requests end (aborted or finished) the
page shows no block in use and no request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.ops.cdp import Page, find_chromium, open_page

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"
)

SCENARIO_DEADLINE_S = 55.0
PROMPT_IDS = list(range(100, 140))  # 40 tokens: two full blocks shared by the samples
LONG_REPLY = "Count from 1 to 500, separated by commas."

USED = "Number(document.getElementById('kv-used').textContent.split('/')[0].replace(/,/g, ''))"
SHARED = "Number(document.getElementById('kv-shared').textContent.replace(/,/g, ''))"
ROWS = "document.querySelectorAll('#requests tbody tr').length"
YOURS = "document.querySelectorAll('#requests .badge:not(.pre)').length"
REPLY = "document.getElementById('reply').textContent"
CHAT_STATE = "document.getElementById('chat-status').dataset.state"
CHAT_STATUS = "document.getElementById('chat-status').textContent"


async def _stream_forever(url: str, model: str) -> None:
    """A long forked request (n=2, EOS ignored), read until cancelled (which aborts it)."""
    body = {
        "model": model,
        "prompt": PROMPT_IDS,
        "n": 2,
        "max_tokens": 300,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for _ in resp.content:
                pass


async def _ask(page: Page, prompt: str, max_tokens: int) -> None:
    """Fill in the playground (greedy) and press Send."""
    await page.evaluate(
        f"""(() => {{
        document.getElementById('prompt').value = {prompt!r};
        document.getElementById('temperature').value = '0';
        document.getElementById('max-tokens').value = '{max_tokens}';
        document.getElementById('send').click();
        return true; }})()"""
    )


async def _idle(page: Page) -> None:
    await page.wait_for(f"{USED} === 0 && {ROWS} === 0", 15)


async def _scenario(url: str, model: str, shot: Path) -> list[str]:
    async with open_page(CHROMIUM) as page:
        await page.goto(f"{url}/")
        await page.wait_for("document.getElementById('conn').dataset.state === 'live'", 15)
        await _idle(page)

        background = asyncio.get_running_loop().create_task(_stream_forever(url, model))
        try:
            # blocks in use, the two prompt blocks shared by both samples, the two samples listed
            await page.wait_for(f"{USED} > 0 && {SHARED} >= 2 && {ROWS} >= 2", 20)

            await _ask(page, LONG_REPLY, 300)
            await page.wait_for(
                f"{YOURS} === 1 && {REPLY}.length > 0 && {CHAT_STATE} === 'streaming'", 20
            )
            await page.screenshot(shot)  # a busy moment
            await page.evaluate("document.getElementById('stop').click(), true")
            await page.wait_for(f"{CHAT_STATE} === 'done'", 10)
            assert "stopped" in await page.evaluate(CHAT_STATUS)
        finally:
            background.cancel()  # the client goes away: the server aborts the request
            try:
                await background
            except asyncio.CancelledError:
                pass
        await _idle(page)

        # a reply that runs to its end
        await _ask(page, "Say hello.", 8)
        await page.wait_for(f"{CHAT_STATE} !== 'streaming'", 30)
        status = await page.evaluate(CHAT_STATUS)
        assert status.startswith("done ("), status
        assert await page.evaluate(f"{REPLY}.length") > 0
        await _idle(page)
        return page.errors


def test_the_dashboard_in_a_browser(
    base_url: str, engine: AsyncEngine, model_name: str, tmp_path: Path
):
    shot = tmp_path / "dashboard.png"
    errors = asyncio.run(
        asyncio.wait_for(_scenario(base_url, model_name, shot), SCENARIO_DEADLINE_S)
    )
    assert errors == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
