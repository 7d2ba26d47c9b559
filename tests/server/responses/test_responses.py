"""POST /v1/responses, GET/DELETE /v1/responses/{id}, the response store."""

from __future__ import annotations

import json
import tracemalloc

import openai
import pytest
from openai.types.responses import Response

from paged_serve.server.responses.store import ResponseStore, StoredResponse
from tests.server.conftest import API_KEYS, assert_error, http, parse_sse

EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta, repeated
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def create(client: openai.OpenAI, model: str, **kw) -> Response:
    kw.setdefault("input", "Name a color.")
    return client.responses.create(model=model, max_output_tokens=4, temperature=0, **kw)


def test_create_retrieve_delete(client: openai.OpenAI, model_name: str):
    made = create(client, model_name, instructions="Answer in one word.")
    Response.model_validate(made.model_dump())
    assert made.object == "response"
    assert made.status in ("completed", "incomplete")
    assert made.output_text
    assert made.instructions == "Answer in one word."
    usage = made.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 1 <= usage.output_tokens <= 4
    if made.status == "incomplete":
        assert made.incomplete_details.reason == "max_output_tokens"
    got = client.responses.retrieve(made.id)
    assert got.id == made.id
    assert got.output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)


def test_store_false_is_not_retrievable(client: openai.OpenAI, base_url: str, model_name: str):
    made = create(client, model_name, store=False)
    assert made.output_text
    reply = http("GET", f"{base_url}/v1/responses/{made.id}")
    assert_error(reply, 404, code="response_not_found")
    assert_error(
        http("GET", f"{base_url}/v1/responses/resp_unknown"), 404, code="response_not_found"
    )


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, model_name: str):
    first = create(client, model_name, input="My name is Ada.", instructions="Be brief.")
    second = create(client, model_name, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    alone = create(client, model_name, input="What is my name?")
    # the second prompt holds the first exchange: its input, its output, the new input
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as info:
        create(client, model_name, input="x", previous_response_id="resp_missing")
    assert info.value.body["param"] == "previous_response_id"


def test_message_items_input(client: openai.OpenAI, model_name: str):
    text = create(client, model_name, input="Name a color.").output_text
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    assert create(client, model_name, input=items).output_text == text


def test_stream_event_order_and_sequence_numbers(base_url: str, model_name: str):
    reply = http(
        "POST",
        f"{base_url}/v1/responses",
        json={"model": model_name, "input": "Say hi.", "max_output_tokens": 4, "stream": True},
    )
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    frames = parse_sse(reply.body)
    events = [json.loads(data) for _, data in frames]
    assert [e["type"] for e in events] == [name for name, _ in frames]  # event: matches type
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas
    assert [k for k in kinds if k != "response.output_text.delta"][:-1] == EVENT_ORDER
    first_delta = kinds.index("response.output_text.delta")
    assert kinds[first_delta : first_delta + len(deltas)] == ["response.output_text.delta"] * len(
        deltas
    )
    final = Response.model_validate(events[-1]["response"])
    assert kinds[-1] == f"response.{final.status}"
    text = "".join(d["delta"] for d in deltas)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == text == final.output_text
    retrieved = http("GET", f"{base_url}/v1/responses/{final.id}").json()
    assert retrieved["output"][0]["content"][0]["text"] == text


def test_stream_through_the_sdk(client: openai.OpenAI, model_name: str):
    events = list(create(client, model_name, input="Say hi.", stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    plain = create(client, model_name, input="Say hi.")
    assert events[-1].response.output_text == plain.output_text


def test_stored_responses_are_scoped_to_the_api_key(keyed_url: str, model_name: str):
    alpha, beta = (
        openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key, max_retries=0) for key in API_KEYS
    )
    made = alpha.responses.create(model=model_name, input="Hi", max_output_tokens=2)
    assert alpha.responses.retrieve(made.id).id == made.id
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.create(
            model=model_name, input="Hi", max_output_tokens=2, previous_response_id=made.id
        )
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(made.id)
    alpha.responses.delete(made.id)


def _entry(owner: str | None = None) -> StoredResponse:
    return StoredResponse.encode({"id": "x"}, [], owner)


def test_store_is_a_bounded_lru():
    store = ResponseStore(2, 1 << 20)
    store.put("a", _entry())
    store.put("b", _entry())
    assert store.get("a", None) is not None  # a is now the most recent
    store.put("c", _entry())
    assert len(store) == 2
    assert store.get("b", None) is None  # evicted
    assert store.get("a", None) is not None and store.get("c", None) is not None
    assert ResponseStore(0, 1 << 20).get("a", None) is None


def test_store_scopes_entries_to_their_owner():
    store = ResponseStore(4, 1 << 20)
    store.put("a", _entry("hash-1"))
    assert store.get("a", "hash-2") is None
    assert store.get("a", None) is None
    assert not store.delete("a", "hash-2")
    assert store.delete("a", "hash-1")
    assert store.get("a", "hash-1") is None


def _sized(i: int, text_bytes: int) -> StoredResponse:
    """An entry whose text (in the response and again in the conversation) is ``text_bytes``."""
    text = f"{i:06d}" + "x" * (text_bytes - 6)
    response = {"id": f"resp_{i}", "output": [{"content": [{"text": text}]}]}
    return StoredResponse.encode(response, [{"role": "assistant", "content": text}], None)


def test_store_is_bounded_by_bytes_and_counts_them_honestly():
    """The issue's case: 200 responses of ~1 MB each once added 200 MB. Under a 16 MiB budget
    the store keeps the newest that fit, and the memory it holds is what it counts."""
    budget = 16 << 20
    store = ResponseStore(1000, budget)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            store.put(f"resp_{i}", _sized(i, 1 << 19))  # ~1 MB of JSON per entry
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.nbytes <= budget
    per_entry = len("resp_199") + _sized(199, 1 << 19).nbytes
    assert len(store) == budget // per_entry
    assert store.get("resp_199", None) is not None and store.get("resp_0", None) is None
    # what the store holds is what it counts, plus well under 1 KB of bookkeeping per entry
    assert store.nbytes <= held <= store.nbytes + 1024 * len(store)


def test_store_evicts_least_recently_used_bytes_first():
    one_third = len("a") + _sized(0, 1000).nbytes
    store = ResponseStore(100, 3 * one_third)
    for name in "abc":
        assert store.put(name, _sized(0, 1000))
    assert store.get("a", None) is not None  # a is now the most recent
    store.put("d", _sized(0, 1000))
    assert store.get("b", None) is None
    assert all(store.get(name, None) is not None for name in "acd")
    assert store.nbytes == 3 * one_third
    assert store.delete("c", None) and store.nbytes == 2 * one_third


def test_an_entry_larger_than_the_budget_is_not_stored():
    store = ResponseStore(100, 10_000)
    assert store.put("small", _sized(0, 100))
    assert not store.put("big", _sized(1, 10_000))
    assert store.get("big", None) is None
    assert store.get("small", None) is not None  # nothing was evicted for it
    assert ResponseStore(100, 0).put("a", _sized(0, 10)) is False
