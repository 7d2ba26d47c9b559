"""POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes)."""

from __future__ import annotations

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import API_KEYS, MAX_MODEL_LEN, assert_error, http

PROMPT = "The capital of France is Paris. Ünïcödé and emoji 🚀 survive."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


def tokenize(base_url: str, body: dict) -> dict:
    reply = http("POST", f"{base_url}/tokenize", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def detokenize(base_url: str, tokens: list[int]) -> str:
    reply = http("POST", f"{base_url}/detokenize", json={"tokens": tokens})
    assert reply.status == 200, reply.body
    return reply.json()["prompt"]


def test_a_prompt_round_trips(base_url: str, engine: AsyncEngine, model_name: str):
    out = tokenize(base_url, {"model": model_name, "prompt": PROMPT})
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["tokens"] == engine.tokenize(PROMPT)  # what /v1/completions runs
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"] is None
    assert detokenize(base_url, out["tokens"]) == PROMPT


def test_token_strs_and_special_tokens(base_url: str, engine: AsyncEngine):
    tokenizer = engine.tokenizer
    out = tokenize(base_url, {"prompt": PROMPT, "return_token_strs": True})
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    bare = tokenize(base_url, {"prompt": PROMPT, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer(PROMPT, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token
    special = tokenize(base_url, {"prompt": f"{eos}x"})["tokens"]
    assert special[0] == tokenizer.eos_token_id  # special tokens in the text are parsed
    assert detokenize(base_url, special) == f"{eos}x"  # and kept when decoding, as vLLM does


def test_chat_messages_count_what_the_chat_endpoint_runs(
    base_url: str, client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    out = tokenize(base_url, {"model": model_name, "messages": MESSAGES})
    reply = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=1, temperature=0
    )
    assert out["count"] == reply.usage.prompt_tokens
    text = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert detokenize(base_url, out["tokens"]) == text
    no_prompt = tokenize(base_url, {"messages": MESSAGES, "add_generation_prompt": False})
    assert out["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    assert no_prompt["count"] < out["count"]
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    continued = tokenize(
        base_url,
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert detokenize(base_url, continued["tokens"]).endswith("The capital is")


def test_tokenizer_info(base_url: str, engine: AsyncEngine):
    reply = http("GET", f"{base_url}/tokenizer_info")
    assert reply.status == 200
    info = reply.json()
    tokenizer = engine.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("tokenize", {}, "prompt"),
        ("tokenize", {"messages": []}, "messages"),
        ("tokenize", {"prompt": 5}, "prompt"),
        ("tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            "tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("detokenize", {"tokens": "abc"}, "tokens"),
        ("detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url: str, path: str, body: dict, param: str):
    assert_error(http("POST", f"{base_url}/{path}", json=body), 400, param=param)


def test_another_model_is_404(base_url: str):
    for path, body in (("tokenize", {"prompt": "x"}), ("detokenize", {"tokens": [1]})):
        reply = http("POST", f"{base_url}/{path}", json={**body, "model": "other"})
        assert_error(reply, 404, param="model", code="model_not_found")


def test_with_api_keys_the_tokenizer_routes_need_one(keyed_url: str):
    for method, path, body in (
        ("POST", "tokenize", {"prompt": "x"}),
        ("POST", "detokenize", {"tokens": [1]}),
        ("GET", "tokenizer_info", None),
    ):
        url = f"{keyed_url}/{path}"
        assert_error(http(method, url, json=body), 401, code="invalid_api_key")
        keyed = http(method, url, json=body, headers={"Authorization": f"Bearer {API_KEYS[0]}"})
        assert keyed.status == 200, keyed.body
