"""Every failure is the OpenAI error object with the right status, param and code."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine, EngineDeadError
from paged_serve.server.generation.sampling import responses_params, sampling_params
from paged_serve.server.protocol.chat import ChatCompletionRequest
from paged_serve.server.protocol.completions import CompletionRequest
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.protocol.responses import ResponsesRequest
from tests.server.conftest import (
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    assert_error,
    http,
    metric_values,
    parse_sse,
    wait_idle,
)

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def post(base_url: str):
    def post(path: str, body: object = None, *, data: bytes | None = None):
        return http("POST", f"{base_url}/v1/{path}", json=body, data=data)

    return post


def test_malformed_json(post):
    for path in ("completions", "chat/completions", "responses"):
        assert_error(post(path, data=b'{"prompt": "x",'), 400)
        assert_error(post(path, data=b""), 400)
        assert_error(post(path, data=b"[1, 2]"), 400)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": True}, "temperature"),
        ("completions", {"prompt": {"text": "x"}}, "prompt"),
        ("completions", {"prompt": [[1, "a"]]}, "prompt[0][1]"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"max_tokens": 3}, "prompt"),
        ("chat/completions", {"messages": "hi"}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("chat/completions", {"messages": []}, "messages"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ("responses", {"input": 5}, "input"),
        ("responses", {"input": "x", "store": "yes"}, "store"),
    ],
)
def test_wrong_types_and_shapes(post, path, body, param):
    assert_error(post(path, body), 400, param=param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
        ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("completions", {"prompt": "x", "n": 0}, "n"),
        ("completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (
            "chat/completions",
            {"messages": CHAT, "prompt_logprobs": 0, "stream": True},
            "prompt_logprobs",
        ),
        ("completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ("chat/completions", {"messages": CHAT, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("completions", {"prompt": [10**9]}, "prompt"),
        ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("chat/completions", {"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"prompt": "x", "repetition_penalty": 1e-300}, "repetition_penalty"),
        ("completions", {"prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty"),
        ("completions", {"prompt": "x", "n": 65, "temperature": 1}, "n"),  # > max_num_seqs 64
        ("chat/completions", {"messages": CHAT, "n": 65}, "n"),
        ("completions", {"prompt": "x", "logit_bias": {"x1": 1}}, "logit_bias"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
        ("chat/completions", {"messages": CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
        ("completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
        (
            "chat/completions",
            {"messages": CHAT, "stop_token_ids": list(range(65))},
            "stop_token_ids",
        ),
        (
            "chat/completions",
            {"messages": CHAT, "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
        ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "chat/completions",
            {"messages": CHAT, "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
        ("responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"input": "x", "top_p": 1.5}, "top_p"),
    ],
)
def test_out_of_range_values(post, path, body, param):
    error = assert_error(post(path, body), 400, param=param)
    assert param.split("[")[0] in error["message"] or param == "prompt"


@pytest.mark.parametrize(
    "to_params, field",
    [
        # constructed, not decoded: msgspec checks ranges only when it decodes
        (
            lambda: sampling_params(
                CompletionRequest(prompt="x", temperature=-1.0), 100, max_tokens=1, logprobs=None
            ),
            "temperature",
        ),
        (
            lambda: sampling_params(
                ChatCompletionRequest(messages=[], top_k=-2), 100, max_tokens=1, logprobs=None
            ),
            "top_k",
        ),
        (
            lambda: responses_params(ResponsesRequest(input="x", top_p=2.0), max_tokens=1),
            "top_p",
        ),
    ],
)
def test_sampling_params_value_error_is_a_400_naming_the_field(to_params, field):
    with pytest.raises(APIError) as info:
        to_params()
    assert (info.value.status, info.value.param) == (400, field)
    assert info.value.message.startswith(f"{field} ")


def test_unknown_model_is_404(post):
    for path, body in [
        ("completions", {"prompt": "x"}),
        ("chat/completions", {"messages": CHAT}),
        ("responses", {"input": "x"}),
    ]:
        assert_error(
            post(path, {**body, "model": "gpt-9"}), 404, param="model", code="model_not_found"
        )


def test_unknown_fields_are_ignored(post):
    reply = post("completions", {"prompt": "x", "max_tokens": 1, "frobnicate": {"a": [1]}})
    assert reply.status == 200


def test_too_long_is_400_with_the_numbers(post, engine: AsyncEngine):
    reply = post("completions", {"prompt": "Hello there", "max_tokens": MAX_MODEL_LEN})
    error = assert_error(reply, 400, param="prompt", code="context_length_exceeded")
    n = len(engine.tokenize("Hello there"))
    assert str(MAX_MODEL_LEN) in error["message"]
    assert str(n + MAX_MODEL_LEN) in error["message"]
    long_chat = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]
    error = assert_error(
        post("chat/completions", {"messages": long_chat}),
        400,
        param="messages",
        code="context_length_exceeded",
    )
    assert str(MAX_MODEL_LEN) in error["message"]


def test_body_too_large_is_413(post):
    reply = post("completions", {"prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert_error(reply, 413)


def test_unknown_route_and_method(base_url: str):
    assert_error(http("GET", f"{base_url}/v1/nothing"), 404)
    assert_error(http("PUT", f"{base_url}/v1/completions"), 405)


def test_queue_full_is_503(
    post, client: openai.OpenAI, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(engine, "max_waiting", 0)
    assert_error(post("completions", {"prompt": "x", "max_tokens": 1}), 503, code="queue_full")
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=engine.model_name, messages=CHAT, n=2, max_tokens=1)
    assert info.value.status_code == 503


def test_queue_full_midway_through_the_prompts_aborts_the_rest(
    post, base_url: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
):
    """The first prompt's request is queued, the second's refused: the first is aborted too."""
    before = metric_values(base_url)["paged_serve_generation_tokens_total"]
    monkeypatch.setattr(engine, "max_waiting", 1)
    body = {"prompt": ["x", "y"], "max_tokens": 64, "ignore_eos": True, "n": 2}
    assert_error(post("completions", body), 503, code="queue_full")
    wait_idle(engine)
    assert metric_values(base_url)["paged_serve_generation_tokens_total"] - before < 64


def test_dead_engine_is_503(post, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(AsyncEngine, "is_alive", property(lambda self: False))
    assert_error(post("completions", {"prompt": "x"}), 503, code="engine_dead")
    assert_error(post("responses", {"input": "x"}), 503, code="engine_dead")


def test_unexpected_exception_is_a_generic_500(
    post, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
):
    def explode(prompt):
        raise RuntimeError("/secret/path/to/file.py went wrong")

    monkeypatch.setattr(engine, "tokenize", explode)
    reply = post("completions", {"prompt": "x", "max_tokens": 1})
    error = assert_error(reply, 500)
    assert "secret" not in reply.body.decode() and "Traceback" not in reply.body.decode()
    assert error["message"] == "internal server error"
    monkeypatch.undo()
    assert post("completions", {"prompt": "x", "max_tokens": 1}).status == 200  # still serving


def _fail_after_first_output(monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine) -> None:
    real = engine.add_request

    def add_request(prompt, params, request_id=None, **kwargs) -> AsyncIterator:
        stream = real(prompt, params, request_id, **kwargs)

        async def fail() -> AsyncIterator:
            try:
                async for out in stream:
                    yield out
                    raise EngineDeadError("simulated engine failure")
            finally:
                await stream.aclose()

        return fail()

    monkeypatch.setattr(engine, "add_request", add_request)


def test_engine_failure_mid_stream_sends_an_error_frame(
    post, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
):
    _fail_after_first_output(monkeypatch, engine)
    body = {"messages": CHAT, "max_tokens": 8, "stream": True}
    reply = post("chat/completions", body)
    assert reply.status == 200
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    error = json.loads(frames[-2][1])
    assert set(error) == {"error"}
    assert error["error"]["code"] == "engine_dead"
    assert error["error"]["type"] == "server_error"
    assert json.loads(frames[0][1])["object"] == "chat.completion.chunk"

    reply = post("responses", {"input": "Hi", "max_output_tokens": 8, "stream": True})
    event, data = parse_sse(reply.body)[-1]
    assert event == "error"
    error = json.loads(data)
    assert error["type"] == "error" and error["code"] == "engine_dead"


def _fail_request_in_engine(monkeypatch: pytest.MonkeyPatch, engine: AsyncEngine) -> None:
    """The engine's fault isolation: a request that fails ends with finish_reason "error"."""
    real = engine.add_request

    def add_request(prompt, params, request_id=None, **kwargs) -> AsyncIterator:
        stream = real(prompt, params, request_id, **kwargs)

        async def fail() -> AsyncIterator:
            try:
                async for out in stream:
                    yield replace(
                        out, finished=True, finish_reason="error", error="internal error: KeyError"
                    )
                    return
            finally:
                await stream.aclose()

        return fail()

    monkeypatch.setattr(engine, "add_request", add_request)


def test_request_failing_in_the_engine_is_a_500(
    post, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
):
    _fail_request_in_engine(monkeypatch, engine)
    reply = post("completions", {"prompt": "x", "max_tokens": 8})
    assert_error(reply, 500, code="generation_failed")
    reply = post("chat/completions", {"messages": CHAT, "max_tokens": 8, "stream": True})
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    assert json.loads(frames[-2][1])["error"]["code"] == "generation_failed"
