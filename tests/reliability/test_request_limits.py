"""Limits on what one request may cost: the sequences it starts (prompts x n), and the
``paged-serve`` flags that set the limits. (The over-the-limit bodies on the default server are
in ``test_bad_input.py``.)
"""

from __future__ import annotations

import pytest

from engine.async_engine import AsyncEngine
from server.app import create_app
from server.cli import build_parser, limits_from_args, main
from server.limits import ServerLimits
from server.state import STATE, ServerState
from tests.reliability.conftest import (
    assert_error_object,
    check_success,
    post,
)
from tests.server.conftest import ServerThread

CAP = 4


@pytest.fixture(scope="module")
def limited(engine: AsyncEngine, server_thread: ServerThread) -> tuple[str, ServerState]:
    app = create_app(engine, limits=ServerLimits(max_sequences_per_request=CAP))
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


# ------------------------------------------------------------------ the flags
def test_the_flags_set_the_limits():
    args = build_parser().parse_args(
        [
            "--max-request-bytes=1000",
            "--max-sequences-per-request=7",
            "--max-stored-responses=9",
        ]
    )
    assert limits_from_args(args) == ServerLimits(
        max_request_bytes=1000,
        max_sequences_per_request=7,
        max_stored_responses=9,
    )
    assert limits_from_args(build_parser().parse_args([])) == ServerLimits()


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-sequences-per-request", "0"),
        ("--max-request-bytes", "0"),
        ("--max-stored-responses", "-1"),
    ],
)
def test_a_bad_flag_value_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        main([f"{flag}={value}"])  # refused before any model is loaded
    assert info.value.code == 2
    assert f"error: {flag} must be" in capsys.readouterr().err
