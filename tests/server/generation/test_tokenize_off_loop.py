"""Tokenizing and chat-template rendering run off the event loop (issue 31, item 7): while
the tokenizer is held inside a request, ``/health`` still answers; and a text too long to fit
the context however it tokenizes is refused before the tokenizer sees it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from paged_serve.server.generation.prompts import max_chars
from tests.server.conftest import assert_error, http

HOLD_S = 10.0


def hold(release: threading.Event, entered: threading.Event, real):
    """``real``, but only once the test releases it."""

    def held(*args, **kwargs):
        entered.set()
        if not release.wait(HOLD_S):
            raise RuntimeError("the test never released the tokenizer")
        return real(*args, **kwargs)

    return held


@pytest.mark.parametrize(
    ("path", "body", "target"),
    [
        ("/tokenize", {"prompt": "hello"}, "engine.tokenize"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 1}, "engine.tokenize"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            "tokenizer.apply_chat_template",
        ),
    ],
)
def test_health_answers_while_a_prompt_is_tokenized(
    engine, base_url: str, monkeypatch, path: str, body: dict, target: str
):
    owner_name, attribute = target.split(".")
    owner = engine if owner_name == "engine" else engine.tokenizer
    release, entered = threading.Event(), threading.Event()
    monkeypatch.setattr(owner, attribute, hold(release, entered, getattr(owner, attribute)))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http, "POST", f"{base_url}{path}", json=body)
        assert entered.wait(HOLD_S)
        # On the loop, this would wait for the held tokenizer, which waits for this answer.
        health = http("GET", f"{base_url}/health")
        release.set()
        reply = pending.result(timeout=60)
    assert health.status == 200
    assert reply.status == 200, reply.body


@pytest.fixture(scope="module")
def big_body_url(engine, server_thread) -> str:
    """A server on the same engine whose body limit admits a text longer than the context."""
    from paged_serve.server.app import create_app
    from paged_serve.server.http.limits import ServerLimits

    limit = 4 * max_chars(engine) + (1 << 20)
    return server_thread.serve(
        lambda: create_app(engine, limits=ServerLimits(max_request_bytes=limit))
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_text_that_cannot_fit_is_refused_before_tokenizing(
    engine, big_body_url: str, monkeypatch, endpoint: str
):
    def never(*args, **kwargs):
        raise AssertionError("the tokenizer ran on a text that cannot fit")

    monkeypatch.setattr(engine, "tokenize", never)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", never)
    text = "x" * (max_chars(engine) + 1)
    if endpoint == "completions":
        path, body, param = "/v1/completions", {"prompt": text}, "prompt"
    else:
        messages = [{"role": "user", "content": text}]
        path, body, param = "/v1/chat/completions", {"messages": messages}, "messages"
    reply = http("POST", f"{big_body_url}{path}", json=body)
    assert_error(reply, 400, param=param, code="context_length_exceeded")
