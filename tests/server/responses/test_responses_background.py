"""Background responses: POST returns at once, GET polls, cancel aborts the engine requests,
a streamed one survives its client and resumes after any sequence number, shutdown cancels
them, and API keys scope them; plus the event log's bounds on its own."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from openai.types.responses import Response

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, limits_from_args
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.responses.background import EventLog
from paged_serve.server.state import STATE
from tests.server.conftest import (
    API_KEYS,
    Reply,
    ServerThread,
    assert_error,
    http,
    metric_values,
    parse_sse,
    wait_idle,
)

LONG = 256  # tokens a response would run for if nobody cancelled it (~8 s on a CPU)
STORY = "Tell a long story about a dragon."
STREAMED = 40  # tokens of the streamed response: long enough to be running when it is resumed
GENERATED = "paged_serve_generation_tokens_total"
DEADLINE_S = 60.0
QUEUED = ("queued", "in_progress")


def _poll(client: openai.OpenAI, response_id: str):
    """Retrieve until the response has ended (bounded)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        assert time.monotonic() < end, f"still {got.status} after {DEADLINE_S} s"
        time.sleep(0.1)


def _wait_generating(base_url: str, before: float, tokens: int = 3) -> None:
    """Until the engine has generated ``tokens`` more tokens than ``before`` (bounded)."""
    end = time.monotonic() + DEADLINE_S
    while metric_values(base_url)[GENERATED] - before < tokens:
        assert time.monotonic() < end, "the background response never started generating"
        time.sleep(0.02)


def test_background_lifecycle_matches_a_foreground_run(client: openai.OpenAI, model_name: str):
    kw = {"model": model_name, "input": "Name a color.", "max_output_tokens": 8, "temperature": 0}
    made = client.responses.create(background=True, **kw)
    assert made.status == "queued"  # answered before the run's first step
    assert made.background is True and made.output == [] and made.usage is None
    Response.model_validate(made.model_dump())
    done = _poll(client, made.id)
    foreground = client.responses.create(**kw)
    assert done.status == foreground.status
    assert done.output_text == foreground.output_text and done.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert done.background is True and foreground.background is False
    # a finished background response cannot be cancelled, as OpenAI answers
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(made.id)
    assert info.value.body["message"] == f"Cannot cancel a {done.status} response."
    assert client.responses.retrieve(made.id).status == done.status  # unchanged


def test_cancel_mid_generation_frees_the_engine(
    client: openai.OpenAI, base_url: str, engine: AsyncEngine, model_name: str
):
    before = metric_values(base_url)[GENERATED]
    made = client.responses.create(
        model=model_name, input=STORY, max_output_tokens=LONG, temperature=0, background=True
    )
    _wait_generating(base_url, before)
    assert client.responses.retrieve(made.id).status == "in_progress"
    cancelled = client.responses.cancel(made.id)
    assert cancelled.id == made.id and cancelled.status == "cancelled"
    assert cancelled.output == [] and cancelled.error is None
    Response.model_validate(cancelled.model_dump())  # the reference's shape, strictly
    at_cancel = metric_values(base_url)[GENERATED]
    wait_idle(engine)
    engine.check_integrity()
    after = metric_values(base_url)
    assert after["paged_serve_kv_blocks_used"] == 0
    assert after[GENERATED] - before < LONG / 2  # it did not run on
    assert after[GENERATED] - at_cancel <= 4  # aborted within a step or so
    assert client.responses.retrieve(made.id).status == "cancelled"
    # cancelling again is idempotent: the cancelled response, unchanged
    again = client.responses.cancel(made.id)
    assert again.model_dump() == client.responses.retrieve(made.id).model_dump()


def test_cancel_refusals(client: openai.OpenAI, base_url: str, model_name: str):
    assert_error(
        http("POST", f"{base_url}/v1/responses/resp_unknown/cancel"),
        404,
        code="response_not_found",
    )
    foreground = client.responses.create(model=model_name, input="Hi", max_output_tokens=1)
    error = assert_error(http("POST", f"{base_url}/v1/responses/{foreground.id}/cancel"), 400)
    assert "background" in error["message"]
    assert client.responses.retrieve(foreground.id).status == foreground.status


async def _read_events(url: str, *, method: str = "GET", body: dict | None = None, stop=None):
    """The events of one SSE reply, as dicts; with ``stop``, the connection is dropped once
    ``stop(events)`` holds."""
    async with aiohttp.ClientSession() as session:
        resp = await session.request(method, url, json=body)
        assert resp.status == 200, await resp.read()
        events, buffer = [], b""
        async for chunk in resp.content.iter_any():
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for raw in frames:
                [(name, data)] = parse_sse(raw + b"\n\n")
                events.append(json.loads(data))
                assert events[-1]["type"] == name
            if stop is not None and stop(events):
                resp.close()  # drop the connection mid-stream
                return events
        assert buffer == b""
        return events


def test_streamed_background_survives_its_client_and_resumes(
    client: openai.OpenAI, base_url: str, model_name: str
):
    body = {
        "model": model_name,
        "input": STORY,
        "max_output_tokens": STREAMED,
        "temperature": 0,
        "background": True,
        "stream": True,
    }
    n = 5

    async def scenario():
        url = f"{base_url}/v1/responses"
        first = await _read_events(
            url, method="POST", body=body, stop=lambda events: len(events) > n
        )
        response_id = first[0]["response"]["id"]
        # the generation goes on without its client: read it all, and everything after n
        # (raw, and through the SDK)
        whole, rest, sdk = await asyncio.gather(
            _read_events(f"{url}/{response_id}?stream=true"),
            _read_events(f"{url}/{response_id}?stream=true&starting_after={n}"),
            asyncio.to_thread(
                lambda: list(client.responses.retrieve(response_id, stream=True, starting_after=n))
            ),
        )
        return first, whole, rest, sdk

    first, whole, rest, sdk = asyncio.run(scenario())
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert first[: n + 1] == whole[: n + 1]
    assert rest == whole[n + 1 :]
    assert [(e.type, e.sequence_number) for e in sdk] == [
        (e["type"], e["sequence_number"]) for e in rest
    ]
    assert whole[0]["type"] == "response.created" and whole[0]["response"]["background"] is True
    final = whole[-1]["response"]
    assert whole[-1]["type"] == "response.incomplete"  # it ran to max_output_tokens
    assert final["usage"]["output_tokens"] == STREAMED
    text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    stored = http("GET", f"{base_url}/v1/responses/{final['id']}").json()
    assert stored["output"][0]["content"][0]["text"] == text
    assert stored["status"] == "incomplete"
    # once it has finished its events are gone: only the stored response remains
    reply = http("GET", f"{base_url}/v1/responses/{final['id']}?stream=true")
    assert_error(reply, 400, param="stream")


def test_a_request_the_engine_ends_makes_the_response_failed(
    base_url: str, engine: AsyncEngine, model_name: str
):
    """An abort the server did not ask for (here from outside; in life an engine error) ends
    the run as ``failed``: its stream's last event is ``response.failed``, and GET says so."""
    body = {"model": model_name, "input": STORY, "max_output_tokens": LONG, "background": True}
    body["stream"] = True

    def abort_once_generating(events: list[dict]) -> bool:
        if len(events) == 5:  # the preamble and the first delta are out
            engine.abort(f"{events[0]['response']['id']}-0")  # the run's engine request
        return False

    events = asyncio.run(
        _read_events(
            f"{base_url}/v1/responses", method="POST", body=body, stop=abort_once_generating
        )
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "aborted" in failed["error"]["message"]
    Response.model_validate(failed)
    stored = http("GET", f"{base_url}/v1/responses/{failed['id']}").json()
    assert stored == failed
    assert_error(http("POST", f"{base_url}/v1/responses/{failed['id']}/cancel"), 400)


def test_retrieve_stream_refusals(client: openai.OpenAI, base_url: str, model_name: str):
    made = client.responses.create(
        model=model_name, input=STORY, max_output_tokens=LONG, temperature=0, background=True
    )
    url = f"{base_url}/v1/responses/{made.id}"
    assert_error(http("GET", f"{url}?stream=true"), 400, param="stream")  # not created streamed
    assert_error(http("GET", f"{url}?starting_after=3"), 400, param="starting_after")
    assert_error(http("GET", f"{url}?stream=true&starting_after=x"), 400, param="starting_after")
    assert_error(http("GET", f"{url}?stream=maybe"), 400, param="stream")
    with pytest.raises(openai.BadRequestError) as info:  # its conversation is not ready yet
        client.responses.create(
            model=model_name, input="And then?", previous_response_id=made.id, max_output_tokens=1
        )
    assert info.value.body["param"] == "previous_response_id"
    # DELETE of a running response cancels it, then deletes it
    assert http("DELETE", url).json() == {"id": made.id, "object": "response", "deleted": True}
    assert_error(http("GET", url), 404, code="response_not_found")
    assert_error(
        http("GET", f"{base_url}/v1/responses/resp_unknown?stream=true"),
        404,
        code="response_not_found",
    )


def test_background_responses_are_scoped_to_the_api_key(keyed_url: str, model_name: str):
    alpha, beta = (
        openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key, max_retries=0) for key in API_KEYS
    )
    made = alpha.responses.create(
        model=model_name, input=STORY, max_output_tokens=LONG, background=True
    )
    for call in (beta.responses.retrieve, beta.responses.cancel, beta.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    headers = {"Authorization": f"Bearer {API_KEYS[1]}"}
    reply = http("GET", f"{keyed_url}/v1/responses/{made.id}?stream=true", headers=headers)
    assert_error(reply, 404, code="response_not_found")
    assert alpha.responses.cancel(made.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        beta.responses.cancel(made.id)
    assert alpha.responses.retrieve(made.id).status == "cancelled"


def test_shutdown_cancels_background_responses(
    engine: AsyncEngine, server_thread: ServerThread, model_name: str
):
    url = server_thread.serve(lambda: create_app(engine))
    runner = server_thread.runners.pop()  # shut down here, not at the session's end
    before = metric_values(url)[GENERATED]
    body = {"model": model_name, "input": STORY, "max_output_tokens": LONG, "background": True}
    made = http("POST", f"{url}/v1/responses", json=body).json()
    _wait_generating(url, before)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), server_thread.loop).result(timeout=30)
    entry = runner.app[STATE].store.get(made["id"], None)
    assert entry is not None and entry.status == "cancelled" and entry.background
    assert json.loads(entry.response)["status"] == "cancelled"
    wait_idle(engine)


def test_a_flood_of_background_responses_stops_at_the_caps(
    engine: AsyncEngine, server_thread: ServerThread, model_name: str
):
    """Per key 4, in all 6: Alice floods 12 at once (4 start, the rest 429), Bob asks for 3
    (2 start, then 503). The engine is held between steps meanwhile, so no run ends early; the
    server keeps answering, every run started finishes, and the places come back."""
    limits = ServerLimits(max_background_responses=6, max_background_responses_per_key=4)
    url = server_thread.serve(lambda: create_app(engine, api_keys=API_KEYS, limits=limits))
    alice, bob = ({"Authorization": f"Bearer {key}"} for key in API_KEYS)
    body = {"model": model_name, "input": "Hi", "max_output_tokens": 2, "background": True}

    async def post_many(headers: dict, count: int) -> list[Reply]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def one() -> Reply:
                async with session.post(f"{url}/v1/responses", json=body, headers=headers) as r:
                    return Reply(r.status, dict(r.headers), await r.read())

            return await asyncio.gather(*(one() for _ in range(count)))

    def wait_ended(reply: Reply, headers: dict) -> None:
        end = time.monotonic() + DEADLINE_S
        url_of_run = f"{url}/v1/responses/{reply.json()['id']}"
        while http("GET", url_of_run, headers=headers).json()["status"] in QUEUED:
            assert time.monotonic() < end, "a background response never ended"
            time.sleep(0.05)

    with engine.between_steps():
        flood = asyncio.run(post_many(alice, 12))
        more = asyncio.run(post_many(bob, 3))
        assert http("GET", f"{url}/health").status == 200  # the server keeps serving
    assert sorted(r.status for r in flood) == [200] * 4 + [429] * 8
    assert sorted(r.status for r in more) == [200, 200, 503]
    for reply in flood + more:
        if reply.status != 200:
            assert_error(reply, reply.status, code="too_many_background_responses")
    for reply, headers in [(r, alice) for r in flood] + [(r, bob) for r in more]:
        if reply.status == 200:
            assert reply.json()["status"] == "queued"
            wait_ended(reply, headers)
    wait_idle(engine)
    engine.check_integrity()
    again = asyncio.run(post_many(alice, 4))  # the runs have ended: the places are back
    assert [r.status for r in again] == [200] * 4
    for reply in again:
        wait_ended(reply, alice)


def test_background_caps_are_flags():
    args = build_parser().parse_args(
        ["--max-background-responses=10", "--max-background-responses-per-key=3"]
    )
    limits = limits_from_args(args)
    assert (limits.max_background_responses, limits.max_background_responses_per_key) == (10, 3)
    default = ServerLimits()
    assert (default.max_background_responses, default.max_background_responses_per_key) == (
        128,
        32,
    )
    with pytest.raises(ValueError, match="--max-background-responses-per-key"):
        limits_from_args(build_parser().parse_args(["--max-background-responses-per-key=0"]))


# ---------------------------------------------------------------- the event log alone
def _frames(log: EventLog, after: int) -> list[bytes]:
    async def read() -> list[bytes]:
        return [f async for f in log.follow(after)]

    return asyncio.run(read())


def test_event_log_keeps_the_newest_bytes_and_refuses_dropped_starts():
    async def fill() -> EventLog:
        log = EventLog(max_bytes=100)
        for i in range(10):
            log.append(b"%02d" % i * 10)  # 20 bytes each
        log.close()
        return log

    log = asyncio.run(fill())
    assert (log.first, log.end, log.nbytes) == (5, 10, 100)
    assert _frames(log, 6) == [b"%02d" % i * 10 for i in (7, 8, 9)]
    assert _frames(log, 4) == [b"%02d" % i * 10 for i in range(5, 10)]
    log.check_resumable(4)
    with pytest.raises(APIError) as info:
        log.check_resumable(3)
    assert info.value.status == 400 and info.value.param == "starting_after"
    assert _frames(log, 9) == []


def test_a_reader_that_falls_behind_gets_an_error_event():
    async def scenario() -> list[bytes]:
        log = EventLog(max_bytes=40)
        log.append(b"a" * 20)
        reader = log.follow(-1)
        got = [await reader.__anext__()]  # frame 0; the reader then stalls
        for _ in range(3):
            log.append(b"b" * 20)  # frame 1 is dropped before the reader reads it
        log.close()
        got += [f async for f in reader]
        return got

    got = asyncio.run(scenario())
    assert got[0] == b"a" * 20
    [(event, data)] = parse_sse(got[1])
    assert len(got) == 2 and event == "error"
    error = json.loads(data)
    assert error["code"] == "stream_events_dropped" and error["sequence_number"] == 1
