"""Take the README's dashboard screenshot (docs/dashboard.png) of a busy moment.

    paged-serve --port 8000 --kv-cache-memory 100663296 &   # a small pool: a readable grid
    python -m tests.server.ops.dashboard_screenshot --url http://127.0.0.1:8000 \\
        --out docs/dashboard.png

For ``--warmup`` seconds a few clients keep the server busy (chats sharing a system prompt, so
the prefix cache hits; n=2 and n=3 completions, so blocks are shared and copied on write;
enough of them that the pool runs short and requests are preempted), which fills the charts.
Then the playground on the page asks its own question, and the screenshot is taken while it
streams with the other requests running. Needs Debian's chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
from pathlib import Path

import aiohttp

from tests.server.ops.cdp import find_chromium, open_page

SYSTEM = (
    "You are a patient teacher of computer systems. Answer in plain words, with one example, "
    "and keep every answer under a hundred words."
)
QUESTIONS = [
    "What is virtual memory?",
    "Why do operating systems use pages?",
    "What is a cache eviction policy?",
    "What does copy-on-write mean?",
    "What is internal fragmentation?",
]


async def _client(session: aiohttp.ClientSession, url: str, seed: int, stop: asyncio.Event):
    rng = random.Random(seed)
    for i in itertools.count():
        if stop.is_set():
            return
        if i % 3 == 2:
            body = {
                "prompt": f"Story {seed}-{i}: once upon a time, in a data centre far away,",
                "n": rng.choice([2, 3]),
                "max_tokens": rng.randint(60, 160),
                "temperature": 1.0,
                "ignore_eos": True,
            }
            path = "/v1/completions"
        else:
            body = {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": rng.choice(QUESTIONS)},
                ],
                "max_tokens": rng.randint(40, 200),
                "temperature": 0.8,
            }
            path = "/v1/chat/completions"
        async with session.post(url + path, json=body) as resp:
            await resp.read()


async def main_async(url: str, out: Path, warmup_s: float, clients: int) -> None:
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(_client(session, url, seed, stop)) for seed in range(clients)]
        async with open_page(chromium, width=1280, height=900) as page:
            await page.goto(url + "/")
            await asyncio.sleep(warmup_s)
            await page.evaluate(
                """(() => {
                document.getElementById('temperature').value = '0.7';
                document.getElementById('max-tokens').value = '160';
                document.getElementById('send').click();
                return true; })()"""
            )
            await page.wait_for(
                "document.getElementById('reply').textContent.length > 120"
                " && document.querySelectorAll('#requests tbody tr').length >= 4",
                120,
            )
            await page.screenshot(out)
            stop.set()
            await page.evaluate("document.getElementById('stop').click(), true")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    parser.add_argument("--warmup", type=float, default=90.0, help="seconds of load first")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main_async(args.url.rstrip("/"), args.out, args.warmup, args.clients))


if __name__ == "__main__":
    main()
