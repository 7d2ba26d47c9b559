"""The client side of ``perf.serving.bench_serving``: greedy ``/v1/completions`` requests over
aiohttp.

``stream_request`` sends one streaming request (``stream_options.include_usage``) and stamps
every SSE chunk that carries text with ``time.perf_counter()`` on arrival: the time to first
token and the inter-token latencies come from those stamps, as in vLLM's ``bench serve``. The
output token count is what the server reports in ``usage``, not the chunk count (a server may
hold back a token whose text is an incomplete character and send it with the next one).

``run_open_loop`` sends each request at its arrival offset (all at once by default);
``run_closed_loop`` keeps ``streams`` requests in flight, each stream sending its next request
when its last one ends. ``complete_all`` sends the mix non-streamed for the correctness check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from perf.serving.workloads import ServingWorkload

TIMEOUT = aiohttp.ClientTimeout(total=3600, sock_read=600)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are ``time.perf_counter()`` seconds."""

    index: int
    max_tokens: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    end: float | None = None
    text: str = ""
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None


def completion_body(
    model: str,
    prompt: list[int],
    max_tokens: int,
    *,
    stream: bool,
    sampling: Mapping[str, Any] | None = None,
    index: int = 0,
) -> dict:
    """A request that runs to ``max_tokens`` (EOS ignored): greedy, or with ``sampling``'s
    fields (``temperature``, ``top_p``, ...) and seed ``index``, so each draw repeats."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if sampling:
        body.update(sampling, seed=index)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def new_session() -> aiohttp.ClientSession:
    """A session that opens a connection per request.

    limit=0: aiohttp's default pool of 100 connections would queue a large mix client-side.
    force_close: reusing a kept-alive connection races with a server closing it (llama-server
    does), which fails the next request's write; a loopback connect costs well under 1 ms.
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    return aiohttp.ClientSession(timeout=TIMEOUT, connector=connector)


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id ``GET /v1/models`` lists."""
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


def _apply_chunk(record: RequestRecord, data: dict, now: float) -> None:
    if "error" in data:
        record.error = json.dumps(data["error"])[:300]
        return
    for choice in data.get("choices") or []:
        text = choice.get("text") or ""
        if text:
            record.chunk_times.append(now)
            record.text += text
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = data.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")


async def stream_request(
    session: aiohttp.ClientSession, base_url: str, body: dict, index: int
) -> RequestRecord:
    """Send one streaming request; a failure is recorded in the result, never raised."""
    record = RequestRecord(index, body["max_tokens"])
    record.start = time.perf_counter()
    try:
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return record
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                _apply_chunk(record, json.loads(payload), now)
        record.end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _streamed_body(
    model: str, workload: ServingWorkload, i: int, sampling: Mapping[str, Any] | None
) -> dict:
    """Request ``i`` of ``workload``, streamed (seed ``i`` when sampled)."""
    return completion_body(
        model,
        workload.prompts[i],
        workload.max_tokens[i],
        stream=True,
        sampling=sampling,
        index=i,
    )


async def run_open_loop(
    base_url: str,
    model: str,
    workload: ServingWorkload,
    offsets: Sequence[float],
    sampling: Mapping[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Each request sent ``offsets[i]`` seconds after the start; the records and the wall
    seconds from the start to the last request's end. ``sampling``: see completion_body."""

    async with new_session() as session:
        start = time.perf_counter()

        async def send(i: int) -> RequestRecord:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = _streamed_body(model, workload, i, sampling)
            return await stream_request(session, base_url, body, i)

        records = await asyncio.gather(*(send(i) for i in range(workload.num_requests)))
        return list(records), time.perf_counter() - start


async def run_closed_loop(
    base_url: str,
    model: str,
    workload: ServingWorkload,
    streams: int,
    sampling: Mapping[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """``streams`` concurrent streams take the requests in order, one at a time each.
    ``sampling``: see completion_body."""
    next_index = 0
    records: list[RequestRecord] = []

    async with new_session() as session:
        start = time.perf_counter()

        async def stream_loop() -> None:
            nonlocal next_index
            while next_index < workload.num_requests:
                i = next_index
                next_index += 1  # no await in between: the event loop makes this atomic
                body = _streamed_body(model, workload, i, sampling)
                records.append(await stream_request(session, base_url, body, i))

        await asyncio.gather(*(stream_loop() for _ in range(streams)))
        wall = time.perf_counter() - start
    return sorted(records, key=lambda r: r.index), wall


@dataclass(frozen=True, slots=True)
class Reply:
    """A non-streamed completion: its text and the server's completion token count."""

    text: str
    completion_tokens: int | None
    error: str | None = None


async def complete_all(base_url: str, model: str, workload: ServingWorkload) -> list[Reply]:
    """Every request of the mix, non-streamed, all at once (for the correctness check)."""

    async def one(session: aiohttp.ClientSession, i: int) -> Reply:
        body = completion_body(model, workload.prompts[i], workload.max_tokens[i], stream=False)
        try:
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    return Reply("", None, f"HTTP {resp.status}: {(await resp.text())[:300]}")
                data = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Reply("", None, f"{type(exc).__name__}: {exc}")
        usage = data.get("usage") or {}
        return Reply(data["choices"][0]["text"], usage.get("completion_tokens"))

    async with new_session() as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(workload.num_requests))))
