"""The prefix cache tells no tenant what another sent: one API key is one tenant (the keyless
requests are one tenant), and vLLM's ``cache_salt`` partitions a tenant further. A prompt
cached for one tenant comes back to another with ``cached_tokens`` 0 (and a full prefill, so
no faster first token); within a tenant the cache serves as before."""

from __future__ import annotations

import uuid

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.reliability.conftest import (
    PATHS,
    assert_error_object,
    assert_pool_clean,
    check_success,
    post,
)
from tests.server.conftest import API_KEYS

ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in API_KEYS)


def _memo() -> str:
    """A ~120-token memo no other test sends (several full KV blocks)."""
    return f"Memo {uuid.uuid4().hex}: the quarterly figures stay confidential until Friday. " * 6


def _body(path: str, text: str, **extra: object) -> dict:
    """A request whose prompt starts with ``text`` (chat: as the system message, which the
    template puts first; else the template's default system prompt would be a block every
    conversation shares, cached by earlier tests)."""
    if path == "completions":
        return {"prompt": text, "max_tokens": 1, "temperature": 0, **extra}
    if path == "chat/completions":
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "Sum up."}]
        return {"messages": messages, "max_tokens": 1, "temperature": 0, **extra}
    return {
        "instructions": text,
        "input": "Sum up.",
        "max_output_tokens": 1,
        "temperature": 0,
        "store": False,
        **extra,
    }


def _cached(url: str, path: str, text: str, headers: dict | None = None, **extra: object) -> int:
    """Send ``text`` once; the prompt tokens the prefix cache served."""
    body = _body(path, text, **extra)
    reply = post(url, path, body, headers=headers)
    check_success(path, body, reply)
    usage = reply.json()["usage"]
    if path == "responses":
        return usage["input_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", PATHS)
def test_one_key_never_hits_what_another_key_cached(
    path: str, keyed_url: str, engine: AsyncEngine
):
    memo = _memo()
    assert _cached(keyed_url, path, memo, ALICE) == 0
    assert _cached(keyed_url, path, memo, BOB) == 0  # Alice's blocks are not Bob's
    assert _cached(keyed_url, path, memo, ALICE) >= 96  # within a key the cache serves
    assert _cached(keyed_url, path, memo, BOB) >= 96
    assert_pool_clean(engine)


@pytest.mark.parametrize("path", PATHS)
def test_cache_salt_partitions_the_cache(path: str, base_url: str, engine: AsyncEngine):
    memo = _memo()
    assert _cached(base_url, path, memo, cache_salt="user-1") == 0
    assert _cached(base_url, path, memo, cache_salt="user-2") == 0
    assert _cached(base_url, path, memo) == 0  # unsalted requests are a partition of their own
    assert _cached(base_url, path, memo, cache_salt="user-1") >= 96
    assert _cached(base_url, path, memo, cache_salt="user-2") >= 96
    assert_pool_clean(engine)


def test_cache_salt_partitions_within_a_key_and_never_across_keys(
    keyed_url: str, engine: AsyncEngine
):
    memo = _memo()
    assert _cached(keyed_url, "completions", memo, ALICE, cache_salt="team") == 0
    assert _cached(keyed_url, "completions", memo, BOB, cache_salt="team") == 0
    assert _cached(keyed_url, "completions", memo, ALICE) == 0
    assert _cached(keyed_url, "completions", memo, ALICE, cache_salt="team") >= 96
    assert_pool_clean(engine)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_cache_salt_must_be_a_non_empty_string(path: str, salt: object, base_url: str):
    body = _body(path, "Hi", cache_salt=salt)
    assert_error_object(post(base_url, path, body), 400, param="cache_salt")
