"""Property-based fuzzing of every POST endpoint's body.

Bodies come in four kinds: strictly valid ones (which must be served), ones whose every field
ranges over its edges (0 tokens, n 129, top_p 0, empty strings, ...), ones mixing such fields
with junk of any JSON type (NaN and infinities included), and random bytes or text. For each,
within a per-request timeout, the server

* never answers 5xx (nothing here is the server's fault);
* answers an error with the OpenAI error object, no traceback or internal path in it;
* answers 200 only with a complete, well-formed object or stream of that endpoint.

Bodies that could be valid always carry a small output limit (at most 4 tokens) and at most
three prompts and n <= 3, so accepted ones stay cheap. Runs are derandomized (the same examples
every time, no database); ``PAGED_SERVE_FUZZ_EXAMPLES=2000`` with ``PAGED_SERVE_FUZZ_SEED``
explores further.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.reliability.conftest import (
    assert_well_formed_error,
    check_success,
    post,
    request,
)

MAX_EXAMPLES = int(os.environ.get("PAGED_SERVE_FUZZ_EXAMPLES", "60"))
SEED = os.environ.get("PAGED_SERVE_FUZZ_SEED")
FUZZ_TIMEOUT_S = 30.0
ACCEPTABLE = {200, 400, 404, 413}

FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=SEED is None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---------------------------------------------------------------------------- strategies
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities included: json.dumps writes them as bare literals
    | st.text(max_size=12)
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
small_text = st.text(max_size=24)
unit = st.floats(min_value=-0.25, max_value=1.25, allow_nan=False)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "output_text", "image_url"])},
    optional={"text": small_text | st.none()},
)
content = st.none() | small_text | st.lists(part, max_size=2)
message = st.fixed_dictionaries({"role": roles}, optional={"content": content, "name": small_text})

COMMON = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9", ""]) | st.none(),
    "temperature": st.floats(min_value=-0.5, max_value=2.5, allow_nan=False) | st.none(),
    "top_p": unit | st.none(),
    "stream": st.booleans() | st.none(),
    "user": small_text | st.none(),
}
SAMPLING = {
    **COMMON,
    "n": st.integers(min_value=-1, max_value=3) | st.just(129) | st.none(),
    "top_k": st.integers(min_value=-3, max_value=60) | st.just(2**40) | st.none(),
    "min_p": unit | st.none(),
    "seed": st.integers(min_value=-(2**64), max_value=2**64) | st.none(),
    "stop": st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans() | st.none(),
    "presence_penalty": st.just(0.0) | st.floats(min_value=-3, max_value=3) | st.none(),
    "logit_bias": st.none() | st.dictionaries(st.text(max_size=4), st.floats(-5, 5), max_size=2),
}
LIMIT = st.integers(min_value=-1, max_value=4) | st.none()
FIELDS = {
    "completions": {
        **SAMPLING,
        "prompt": small_text
        | st.lists(small_text, max_size=3)
        | st.lists(st.integers(min_value=-2, max_value=49_160), max_size=6)
        | st.lists(st.lists(st.integers(min_value=0, max_value=49_151), max_size=4), max_size=3),
        "max_tokens": LIMIT,
        "echo": st.booleans() | st.none(),
        "logprobs": st.integers(min_value=-1, max_value=6) | st.none(),
        "suffix": st.none() | small_text,
        "best_of": st.none() | st.integers(min_value=0, max_value=3),
    },
    "chat/completions": {
        **SAMPLING,
        "messages": st.lists(message, max_size=3),
        "max_tokens": LIMIT,
        "max_completion_tokens": LIMIT,
        "logprobs": st.booleans() | st.none(),
        "top_logprobs": st.integers(min_value=-1, max_value=21) | st.none(),
        "tools": st.none() | st.lists(junk, max_size=1),
        "response_format": st.none()
        | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    },
    "responses": {
        **COMMON,
        "input": small_text
        | st.lists(
            st.fixed_dictionaries(
                {"role": roles, "content": small_text | st.lists(part, max_size=2)},
                optional={"type": st.sampled_from(["message", "function_call"])},
            ),
            max_size=3,
        ),
        "instructions": st.none() | small_text,
        "max_output_tokens": LIMIT,
        "store": st.booleans() | st.none(),
        "previous_response_id": st.none() | small_text,
        "metadata": st.none() | st.dictionaries(st.text(max_size=4), small_text | st.integers()),
        "tools": st.none() | st.lists(junk, max_size=1),
    },
}
REQUIRED = {"completions": "prompt", "chat/completions": "messages", "responses": "input"}
LIMITS = {
    "completions": ("max_tokens",),
    "chat/completions": ("max_tokens", "max_completion_tokens"),
    "responses": ("max_output_tokens",),
}


# Strictly valid fields: a body made of these alone must be served.
text = st.text(min_size=1, max_size=24)
valid_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2
        ),
    }
)
VALID_COMMON = {
    "model": st.just("SmolLM2-135M-Instruct") | st.none(),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "stream": st.booleans(),
    "user": text,
}
VALID_SAMPLING = {
    **VALID_COMMON,
    "n": st.integers(min_value=1, max_value=3),
    "top_k": st.integers(min_value=-1, max_value=60),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 128),
    "stop": text | st.lists(text, min_size=1, max_size=4),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
}
VALID_LIMIT = st.integers(min_value=1, max_value=4)
VALID_FIELDS = {
    "completions": {
        **VALID_SAMPLING,
        "prompt": text
        | st.lists(text, min_size=1, max_size=3)
        | st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=6)
        | st.lists(
            st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=4),
            min_size=1,
            max_size=3,
        ),
        "max_tokens": VALID_LIMIT,
        "echo": st.booleans(),
        "logprobs": st.integers(min_value=0, max_value=5),
    },
    "chat/completions": {
        **VALID_SAMPLING,
        "messages": st.lists(valid_message, min_size=1, max_size=3),
        "max_tokens": VALID_LIMIT,
        "max_completion_tokens": VALID_LIMIT,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(min_value=0, max_value=20),
    },
    "responses": {
        **VALID_COMMON,
        "input": text
        | st.lists(
            st.fixed_dictionaries(
                {"role": valid_message.map(lambda m: m["role"]), "content": text}
            ),
            min_size=1,
            max_size=3,
        ),
        "instructions": text,
        "max_output_tokens": VALID_LIMIT,
        "store": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=4), text, max_size=2),
    },
}


def _valid_body(path: str) -> st.SearchStrategy[dict]:
    """A body the server must serve: valid fields, their cross-field rules respected."""
    fields = VALID_FIELDS[path]
    required = REQUIRED[path]
    optional = {name: s for name, s in fields.items() if name != required}
    return st.fixed_dictionaries({required: fields[required]}, optional=optional).map(
        lambda b: _cheap(path, _consistent(b))
    )


def _consistent(body: dict) -> dict:
    if not body.get("stream"):
        body.pop("stream_options", None)
    if body.get("echo"):
        body.pop("logprobs", None)
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)
    return body


def _body(path: str, mixed: bool) -> st.SearchStrategy[dict]:
    """A dict of the endpoint's fields (each present or not; with ``mixed``, each valid or
    junk), plus a few unknown fields, the required one usually present."""
    fields = FIELDS[path]
    pick = (lambda s: s | junk) if mixed else (lambda s: s)
    optional = {name: pick(s) for name, s in fields.items() if name != REQUIRED[path]}
    required = {REQUIRED[path]: pick(fields[REQUIRED[path]])}
    extra = st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k not in fields), junk, max_size=2
    )
    known = st.one_of(
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries({}, optional={**required, **optional}),
    )
    return st.builds(lambda a, b: {**b, **a}, known, extra).map(lambda b: _cheap(path, b))


def _cheap(path: str, body: dict) -> dict:
    """Keep bodies that could be valid cheap: a small output limit unless one is set."""
    limits = LIMITS[path]
    if all(body.get(name) is None for name in limits):
        body[limits[0]] = 2
    return body


def bodies(path: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """``(kind, payload)``; "valid" bodies (two draws in five) must get a 200."""
    kinds = {
        "valid": _valid_body(path),
        "edgy": _body(path, mixed=False),
        "mixed": _body(path, mixed=True),
    }
    noise = st.binary(max_size=200) | st.text(max_size=200).map(str.encode)

    def draw(kind: str) -> st.SearchStrategy[tuple[str, bytes]]:
        if kind == "noise":
            return noise.map(lambda b: (kind, b))
        return kinds[kind].map(lambda b: (kind, json.dumps(b).encode()))

    return st.sampled_from(["valid", "valid", "edgy", "mixed", "noise"]).flatmap(draw)


# ---------------------------------------------------------------------------- the property
def _check(base_url: str, path: str, kind: str, payload: bytes) -> None:
    reply = post(base_url, path, data=payload, timeout=FUZZ_TIMEOUT_S)
    assert reply.status in ACCEPTABLE, (reply.status, payload[:300], reply.body[:300])
    if kind == "valid":
        assert reply.status == 200, (payload[:300], reply.body[:300])
    if reply.status != 200:
        assert_well_formed_error(reply, sent=payload)
        return
    check_success(path, json.loads(payload), reply)


def _fuzz(path: str) -> Callable[[str], None]:
    @FUZZ_SETTINGS
    @given(drawn=bodies(path))
    def run(base_url: str, drawn: tuple[str, bytes]) -> None:
        _check(base_url, path, *drawn)

    if SEED is not None:
        run = seed(int(SEED))(run)

    def test(base_url: str) -> None:
        run(base_url)
        assert request("GET", f"{base_url}/health").status == 200  # still serving

    test.__doc__ = f"Fuzzed bodies for /v1/{path}: no 5xx, no hang, well-formed answers."
    return test


test_fuzz_completions = _fuzz("completions")
test_fuzz_chat_completions = _fuzz("chat/completions")
test_fuzz_responses = _fuzz("responses")
