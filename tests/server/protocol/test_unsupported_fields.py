"""Documented chat/completions fields this server does not implement are a 400 naming the
field when set (``paged_serve.server.protocol.unsupported``); their "not used" values, the fields
OpenAI lets a server ignore, and unknown names are served."""

from __future__ import annotations

import pytest

from paged_serve.server.protocol.unsupported import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    IGNORED_BY_SPEC,
)
from tests.server.conftest import assert_error, http

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
BODIES = {"chat/completions": (CHAT, CHAT_REFUSED), "completions": (COMPLETION, COMPLETION_REFUSED)}

# What a client would send to use each field (a test for every entry of the tables).
SHARED_EXAMPLES = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "allowed_token_ids": [1, 2],
    "bad_words": ["Paris"],
    "truncate_prompt_tokens": 8,
    "spaces_between_special_tokens": False,
    "logits_processors": ["my_module.MyLogitsProcessor"],
    "priority": 1,
    "request_id": "my-request-1",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"my_arg": 1},
    "repetition_detection": {"max_pattern_size": 8},
    "structural_tag": '{"type": "structural_tag"}',
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": r"[\n ]*",
}
EXAMPLES = {
    "chat/completions": {
        "audio": {"voice": "alloy", "format": "wav"},
        "modalities": ["text", "audio"],
        "prediction": {"type": "content", "content": "Hello"},
        "web_search_options": {},
        "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}],
        "function_call": {"name": "f"},
        "reasoning_effort": "high",
        "verbosity": "low",
        "store": True,
        "add_special_tokens": True,
        "documents": [{"title": "Paris", "text": "Paris is the capital of France."}],
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "media_io_kwargs": {"video": {"num_frames": 4}},
        "mm_processor_kwargs": {"num_crops": 4},
        "include_reasoning": False,
        **SHARED_EXAMPLES,
    },
    "completions": {
        "suffix": " and that is all.",
        "add_special_tokens": False,
        "prompt_embeds": "UEsDBBQAAAAIAA==",
        **SHARED_EXAMPLES,
    },
}
IGNORED_EXAMPLES = {
    "user": "user-1234",
    "safety_identifier": "hashed-user-1234",
    "service_tier": "flex",
    "prompt_cache_key": "my-app",
    "prompt_cache_retention": "24h",
    "metadata": {"team": "search"},
}


def post(base_url: str, path: str, body: dict):
    return http("POST", f"{base_url}/v1/{path}", json=body)


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_every_refused_field_has_an_example(path: str):
    assert set(EXAMPLES[path]) == set(BODIES[path][1])
    assert set(IGNORED_EXAMPLES) == set(IGNORED_BY_SPEC)


@pytest.mark.parametrize(
    "path, field", [(path, field) for path in sorted(EXAMPLES) for field in EXAMPLES[path]]
)
def test_a_refused_field_is_a_400_naming_it(base_url: str, path: str, field: str):
    body = {**BODIES[path][0], field: EXAMPLES[path][field]}
    error = assert_error(post(base_url, path, body), 400, param=field)
    assert error["message"].startswith(f"this server does not implement {field}: ")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_unused_values_are_served(base_url: str, path: str, stream: bool):
    base, table = BODIES[path]
    for values in (
        {f: None for f in table},
        {f: r.unused[0] for f, r in table.items() if r.unused},
    ):
        reply = post(base_url, path, {**base, **values, "stream": stream})
        assert reply.status == 200, (values, reply.body)


@pytest.mark.parametrize(
    "field, value", [("use_beam_search", 0), ("priority", False), ("length_penalty", True)]
)
def test_unused_means_the_same_json_type(base_url: str, field: str, value: object):
    assert_error(post(base_url, "completions", {**COMPLETION, field: value}), 400, param=field)


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_fields_a_server_may_ignore_and_unknown_names_are_served(base_url: str, path: str):
    base = BODIES[path][0]
    plain = post(base_url, path, base)
    assert plain.status == 200, plain.body
    for extra in (IGNORED_EXAMPLES, {"no_such_field": {"at": "all"}}):
        reply = post(base_url, path, {**base, **extra})
        assert reply.status == 200, (extra, reply.body)
        assert reply.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_best_of_other_than_n(base_url: str, path: str):
    base = BODIES[path][0]
    assert post(base_url, path, {**base, "best_of": 1}).status == 200
    assert_error(post(base_url, path, {**base, "n": 1, "best_of": 2}), 400, param="best_of")
