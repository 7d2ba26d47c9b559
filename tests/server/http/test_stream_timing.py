"""A stream's first chunk goes out with the first generated token, not before the prefill:
benchmark clients (vLLM's ``bench serve``, guidellm) start their time-to-first-token clock at
the first chunk, so a chunk sent early (the chat ``role`` delta, a completions ``echo``) would
make the TTFT they measure look shorter than it is.

A gate around the engine's ``step`` holds the engine for a moment before the step that admits
the request (and prefills it), then records when that step has returned; the client records
when its first ``data:`` frame arrives. The frame must come after the step.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.llm_engine import LLMEngine

HOLD_S = 0.3  # long enough for a chunk sent before the prefill to reach the client


class HoldFirstPrefill:
    """Holds the engine thread ``HOLD_S`` before the first step that admits a waiting request,
    and records when that step returned (``time.monotonic()``)."""

    def __init__(self, llm_engine: LLMEngine):
        self.llm_engine = llm_engine
        self.prefilled_at: float | None = None
        self.done = threading.Event()
        self._real = llm_engine.step
        llm_engine.step = self._step

    def close(self) -> None:
        del self.llm_engine.step

    def _step(self) -> list:
        if self.done.is_set() or not self.llm_engine.scheduler.waiting:
            return self._real()
        time.sleep(HOLD_S)
        outputs = self._real()
        self.prefilled_at = time.monotonic()
        self.done.set()
        return outputs


async def first_frame_time(url: str, body: dict) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    arrived = time.monotonic()
                    await resp.read()  # the rest of the stream
                    return arrived
    raise AssertionError("the stream sent no data frame")


@pytest.mark.parametrize(
    "path, body",
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "n": 2}),
        ("completions", {"prompt": "Say hi.", "echo": True}),
        ("completions", {"prompt": "Say hi.", "echo": True, "logprobs": 1}),
    ],
    ids=["chat-role-delta", "completions-echo", "completions-echo-logprobs"],
)
def test_the_first_chunk_comes_after_the_prefill(
    base_url: str, engine: AsyncEngine, path: str, body: dict
):
    gate = HoldFirstPrefill(engine.engine)
    try:
        body = {**body, "max_tokens": 2, "temperature": 0, "stream": True}
        arrived = asyncio.run(first_frame_time(f"{base_url}/v1/{path}", body))
    finally:
        gate.close()
    assert gate.done.is_set()
    assert arrived > gate.prefilled_at
