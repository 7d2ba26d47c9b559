"""Limits on what one request may cost: the sequences it starts (prompts x n), the bytes the
response store keeps for it, OpenAI's bounds on ``metadata`` and ``user`` at their edges, and
the ``paged-serve`` flags that set them. (The over-the-limit bodies on the default server are
in ``test_bad_input.py``.)
"""

from __future__ import annotations

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, limits_from_args, main
from paged_serve.server.http.limits import ServerLimits
from paged_serve.server.state import STATE, ServerState
from tests.reliability.conftest import (
    assert_error_object,
    check_success,
    post,
    request,
)
from tests.server.conftest import ServerThread

CAP = 4
STORE_BUDGET = 12_000  # bytes: two or three of the responses below
# OpenAI's maximum: 16 pairs, keys of 64 characters, values of 512 (9.5 KB of JSON)
FULL_METADATA = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}


@pytest.fixture(scope="module")
def limited(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    limits = ServerLimits(max_sequences_per_request=CAP, max_response_store_bytes=STORE_BUDGET)
    app = create_app(engine, limits=limits)
    return server_thread.serve(lambda: app), app[STATE]


# ------------------------------------------------------------------ sequences per request
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "Hi", "n": CAP + 1}, "n"),
        ("completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
        ("completions", {"prompt": [[1]] * (CAP + 1)}, "prompt"),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": CAP + 1}, "n"),
    ],
    ids=["n", "prompts-times-n", "prompts", "chat-n"],
)
def test_more_sequences_than_the_cap_is_400(limited, path: str, body: dict, param: str):
    url, _ = limited
    body = {**body, "max_tokens": 1, "temperature": 1}
    error = assert_error_object(post(url, path, body), 400, param=param)
    assert str(CAP) in error["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("completions", {"prompt": ["a", "b"], "n": 2}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": CAP}),
        ("responses", {"input": "Hi"}),
    ],
    ids=["completions", "chat", "responses"],
)
def test_up_to_the_cap_is_served(limited, path: str, body: dict):
    url, _ = limited
    limit = "max_output_tokens" if path == "responses" else "max_tokens"
    body = {**body, limit: 1, "temperature": 1}
    check_success(path, body, post(url, path, body))


# ------------------------------------------------------------------ the response store
def _stored(url: str, response_id: str) -> bool:
    reply = request("GET", f"{url}/v1/responses/{response_id}")
    assert reply.status in (200, 404), reply.body[:200]
    return reply.status == 200


def _respond(url: str, text: str, **fields: object) -> dict:
    body = {"input": text, "max_output_tokens": 1, "temperature": 0, **fields}
    reply = post(url, "responses", body)
    check_success("responses", body, reply)
    return reply.json()


def test_the_store_keeps_to_its_byte_budget(limited):
    """Responses of ~5 KB (metadata and a long input) into a 12 KB store: the oldest go, the
    store never holds more than its budget, and the newest is retrievable."""
    url, state = limited
    metadata = {f"{i:02d}" + "k" * 62: "v" * 60 for i in range(16)}
    ids = []
    for i in range(8):
        ids.append(_respond(url, f"{i} " + "word " * 200, metadata=metadata)["id"])
        assert state.store.nbytes <= STORE_BUDGET
    kept = [_stored(url, rid) for rid in ids]
    assert kept[-1] and not kept[0]
    assert kept == sorted(kept)  # least recently used went first
    assert 2 <= sum(kept) < len(ids)
    fetched = request("GET", f"{url}/v1/responses/{ids[-1]}").json()
    assert fetched["metadata"] == metadata


def test_a_response_larger_than_the_whole_budget_is_returned_but_not_stored(limited):
    url, state = limited
    before = _respond(url, "small")["id"]
    made = _respond(url, "word " * 400, metadata=FULL_METADATA)
    assert made["status"] in ("completed", "incomplete")
    assert not _stored(url, made["id"])
    assert _stored(url, before)  # nothing was evicted for it
    assert state.store.nbytes <= STORE_BUDGET


# ------------------------------------------------------------------ OpenAI's edges
def test_metadata_and_user_at_openai_limits_are_served(base_url: str):
    body = {"input": "Hi", "max_output_tokens": 1, "metadata": FULL_METADATA, "user": "u" * 64}
    reply = post(base_url, "responses", body)
    check_success("responses", body, reply)
    assert reply.json()["metadata"] == FULL_METADATA
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, prompt in (("completions", {"prompt": "Hi"}), ("chat/completions", chat)):
        body = {**prompt, "max_tokens": 1, "user": "u" * 64}
        check_success(path, body, post(base_url, path, body))


# ------------------------------------------------------------------ the flags
def test_the_flags_set_the_limits():
    args = build_parser().parse_args(
        [
            "--max-request-bytes=1000",
            "--max-sequences-per-request=7",
            "--max-stored-responses=9",
            "--max-response-store-bytes=4096",
            "--header-timeout=2.5",
            "--body-timeout=3",
            "--max-connections=11",
        ]
    )
    assert limits_from_args(args) == ServerLimits(
        max_request_bytes=1000,
        max_sequences_per_request=7,
        max_stored_responses=9,
        max_response_store_bytes=4096,
        header_timeout_s=2.5,
        body_timeout_s=3.0,
        max_connections=11,
    )
    assert limits_from_args(build_parser().parse_args([])) == ServerLimits()


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-sequences-per-request", "0"),
        ("--max-connections", "0"),
        ("--header-timeout", "0"),
        ("--body-timeout", "nan"),
        ("--max-response-store-bytes", "-1"),
        ("--max-request-bytes", "0"),
    ],
)
def test_a_bad_flag_value_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        main([f"{flag}={value}"])  # refused before any model is loaded
    assert info.value.code == 2
    assert f"error: {flag} must be" in capsys.readouterr().err
