"""vLLM's ``prompt_logprobs`` cannot turn a small request into a reply of tens of megabytes
built on the event loop (issue 31, item 10): a reply whose lists would hold more than
``max_prompt_logprob_entries`` entries (prompt tokens x (prompt_logprobs + 1), over its
choices) is refused before any work, and a reply under the bound is built and encoded off the
loop, so ``/health`` answers meanwhile."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.cli import build_parser, limits_from_args, main
from paged_serve.server.generation import logprobs
from paged_serve.server.http.limits import ServerLimits
from tests.server.conftest import ServerThread, assert_error, http

HOLD_S = 10.0
CHAT = [{"role": "user", "content": "Hi"}]
HEALTH_TIMEOUT_S = 3.0
SMALL_LIMIT = 100 * 21  # 100 prompt tokens at 20 alternatives


def _ids(count: int) -> list[int]:
    return [1000 + 7 * i for i in range(count)]


@pytest.fixture(scope="module")
def small_limit(engine: AsyncEngine, server_thread: ServerThread) -> str:
    limits = ServerLimits(max_prompt_logprob_entries=SMALL_LIMIT)
    return server_thread.serve(lambda: create_app(engine, limits=limits))


def test_a_reply_beyond_the_default_bound_is_refused(base_url: str):
    """13 choices of a 1000-token prompt at 20 alternatives: 273,000 entries, ~20 MB of JSON
    from a 5 KB request. Before, it was built on the event loop."""
    body = {"prompt": _ids(1000), "max_tokens": 1, "n": 13, "prompt_logprobs": 20}
    error = assert_error(
        http("POST", f"{base_url}/v1/completions", json=body), 400, param="prompt_logprobs"
    )
    assert "273,000 entries" in error["message"]


@pytest.mark.parametrize(
    "prompt_tokens, n, top, served",
    [(100, 1, 20, True), (101, 1, 20, False), (100, 2, 20, False), (1000, 1, 1, True)],
)
def test_the_bound_counts_prompt_tokens_alternatives_and_choices(
    small_limit: str, prompt_tokens: int, n: int, top: int, served: bool
):
    body = {"prompt": _ids(prompt_tokens), "max_tokens": 1, "n": n, "prompt_logprobs": top}
    reply = http("POST", f"{small_limit}/v1/completions", json=body)
    if not served:
        assert_error(reply, 400, param="prompt_logprobs")
        return
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    assert [len(c["prompt_logprobs"]) for c in choices] == [prompt_tokens] * n


@pytest.mark.parametrize("words, served", [(1, True), (200, False)])
def test_chat_is_bounded_too(small_limit: str, words: int, served: bool):
    messages = [{"role": "user", "content": "word " * words}]
    body = {"messages": messages, "max_tokens": 1, "prompt_logprobs": 20}
    reply = http("POST", f"{small_limit}/v1/chat/completions", json=body)
    if served:
        assert reply.status == 200, reply.body
        assert reply.json()["prompt_logprobs"][0] is None
    else:
        assert_error(reply, 400, param="prompt_logprobs")


async def _health_within(url: str, timeout_s: float) -> int:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/health") as resp:
            return resp.status


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": _ids(64), "max_tokens": 1, "prompt_logprobs": 5}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 5}),
    ],
)
def test_health_answers_while_a_prompt_logprobs_reply_is_built(
    base_url: str, monkeypatch: pytest.MonkeyPatch, path: str, body: dict
):
    """The build is held at its first token's text; on the loop, ``/health`` would wait."""
    release, entered = threading.Event(), threading.Event()
    real = logprobs.token_text

    def held(tokenizer: object, token_id: int) -> str:
        entered.set()
        if not release.wait(HOLD_S):
            raise RuntimeError("the test never released the build")
        return real(tokenizer, token_id)

    monkeypatch.setattr(logprobs, "token_text", held)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http, "POST", f"{base_url}{path}", json=body)
        try:
            assert entered.wait(HOLD_S)
            health = asyncio.run(_health_within(base_url, HEALTH_TIMEOUT_S))
        finally:
            release.set()
        reply = pending.result(timeout=60)
    assert health == 200
    assert reply.status == 200, reply.body
    scored = reply.json()
    if path == "/v1/completions":
        lists = [choice["prompt_logprobs"] for choice in scored["choices"]]
    else:
        lists = [scored["prompt_logprobs"]]
    assert all(entries[0] is None and entries[1] for entries in lists)


def test_the_flag_sets_the_bound(capsys: pytest.CaptureFixture[str]):
    args = build_parser().parse_args(["--max-prompt-logprob-entries=5000"])
    assert limits_from_args(args).max_prompt_logprob_entries == 5000
    with pytest.raises(SystemExit):
        main(["--max-prompt-logprob-entries=0"])
    assert "error: --max-prompt-logprob-entries must be" in capsys.readouterr().err
