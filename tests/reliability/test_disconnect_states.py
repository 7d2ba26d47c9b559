"""A client that hangs up frees its request whatever state the request is in - queued, mid
prefill, mid decode or preempted - and the request running beside it is not disturbed.

The moment is made exact, not left to timing: a gate wrapped around the engine's ``step``
pauses the engine thread right after the step that puts request B in the wanted state. The
client then hangs up, the test waits until the server has handed the abort to the engine, and
releases the gate; the engine applies the abort before its next step, and a recorder around
``LLMEngine.abort`` reports the state B was in.

Block arithmetic (16-token blocks, a 12-block pool, prefill chunks of at most 32 tokens): A has
95 prompt tokens (6 blocks) and 12 to generate (7 blocks at its end); B has 79 (5 blocks) and
needs a 6th at its second decode, when A already holds 7: the pool is empty, and B, admitted
last, is preempted. B cannot come back (6 blocks, 5 free) until A finishes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable

import aiohttp
import pytest

from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sched.request import Request, RequestStatus
from paged_serve.engine.sched.scheduler import Scheduler
from perf.serving.load_test import AbortRecorder, sse_events
from tests.reliability.conftest import LocalServer, assert_pool_clean

A_IDS = [1000 + 7 * i for i in range(95)]
B_IDS = [20_000 + 11 * i for i in range(79)]
A_TOKENS = 12
GATE_TIMEOUT_S = 60.0
SCENARIO_TIMEOUT_S = 120.0


class StepGate:
    """Pauses the engine thread after the first step for which the armed predicate holds."""

    def __init__(self, llm_engine: LLMEngine):
        self.llm_engine = llm_engine
        self.paused = threading.Event()
        self._release = threading.Event()
        self._predicate: Callable[[Scheduler], bool] | None = None
        self._real = llm_engine.step
        llm_engine.step = self._step

    def arm(self, predicate: Callable[[Scheduler], bool]) -> None:
        self.paused.clear()
        self._release.clear()
        self._predicate = predicate

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._predicate = None
        self._release.set()
        del self.llm_engine.step

    def _step(self) -> list:
        outputs = self._real()
        predicate = self._predicate
        if predicate is not None and predicate(self.llm_engine.scheduler):
            self._predicate = None
            self.paused.set()
            self._release.wait(GATE_TIMEOUT_S)
        return outputs


def _b(scheduler: Scheduler) -> Request | None:
    return next(
        (r for r in [*scheduler.running, *scheduler.waiting] if r.prompt_token_ids == B_IDS), None
    )


def _b_in(state: str) -> Callable[[Scheduler], bool]:
    def holds(scheduler: Scheduler) -> bool:
        b = _b(scheduler)
        if b is None:
            return False
        if state == "prefill":
            return b.status is RequestStatus.RUNNING and 0 < b.num_computed_tokens < len(B_IDS)
        if state == "decode":
            return b.status is RequestStatus.RUNNING and len(b.output_token_ids) >= 2
        return b.status is RequestStatus.WAITING and b.num_preemptions > 0  # preempted

    return holds


async def _read_stream(resp: aiohttp.ClientResponse, first_token: asyncio.Event) -> dict:
    """A completions stream to its end: the finish reason, usage and any error."""
    seen: dict = {"finish_reason": None, "usage": None, "error": None}
    async for _, data in sse_events(resp):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            seen["error"] = chunk["error"]
            continue
        for choice in chunk["choices"]:
            first_token.set()
            seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
        seen["usage"] = chunk.get("usage") or seen["usage"]
    return seen


def _body(ids: list[int], max_tokens: int) -> dict:
    return {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _wait_for(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(GATE_TIMEOUT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _scenario(local: LocalServer, gate: StepGate, state: str) -> dict:
    url = f"{local.url}/v1/completions"
    async with aiohttp.ClientSession() as session:
        a_resp = await session.post(url, json=_body(A_IDS, A_TOKENS))
        assert a_resp.status == 200
        a_first = asyncio.Event()
        a_task = asyncio.create_task(_read_stream(a_resp, a_first))
        await a_first.wait()  # A is running: B will be admitted after it
        if state == "queued":
            gate.arm(lambda scheduler: True)  # hold the engine before B reaches it
            assert await asyncio.to_thread(gate.paused.wait, GATE_TIMEOUT_S)
        else:
            gate.arm(_b_in(state))
        b_resp = await session.post(url, json=_body(B_IDS, A_TOKENS))
        assert b_resp.status == 200  # headers are out: B is in the engine's inbox
        if state != "queued":
            assert await asyncio.to_thread(gate.paused.wait, GATE_TIMEOUT_S)
        b_resp.close()  # hang up
        await _wait_for(lambda: len(local.state.in_flight) == 1, "the server to abort B")
        gate.release()
        a = await a_task
        a_resp.close()
    return a


@pytest.mark.parametrize("state", ["queued", "prefill", "decode", "preempted"])
def test_a_disconnect_frees_the_request_in_every_state(small_pool: LocalServer, state: str):
    gate = StepGate(small_pool.engine.engine)
    recorder = AbortRecorder(small_pool.engine.engine)
    try:
        a = asyncio.run(asyncio.wait_for(_scenario(small_pool, gate, state), SCENARIO_TIMEOUT_S))
    finally:
        gate.close()
        recorder.close()
    assert recorder.states == Counter({state: 1})
    # A, running beside B all along, got its whole answer.
    assert a["error"] is None
    assert a["finish_reason"] == "length"
    assert a["usage"]["completion_tokens"] == A_TOKENS
    assert_pool_clean(small_pool.engine)
