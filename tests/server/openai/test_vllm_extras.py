"""vLLM's extra chat/completions fields: the chat template flags, chat ``echo``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``include_stop_str_in_output`` and
``stream_options.continuous_usage_stats``. Raw HTTP, so every field of the replies is seen."""

from __future__ import annotations

import json

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import assert_error, http, parse_sse

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARTIAL = "The capital of France is"
PREFILLED = [*QUESTION, {"role": "assistant", "content": PARTIAL}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
GREEDY = {"temperature": 0, "max_tokens": 6}
# longer than any text the few tokens produce: the detokenizer holds the text back while the
# ids go out, so early outputs have ids and no text
NEVER_STOP = "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@"


def post(base_url: str, path: str, body: dict) -> dict:
    reply = http("POST", f"{base_url}/v1/{path}", json={**GREEDY, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def stream(base_url: str, path: str, body: dict) -> list[dict]:
    reply = http("POST", f"{base_url}/v1/{path}", json={**GREEDY, **body, "stream": True})
    assert reply.status == 200, reply.body
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    return [json.loads(data) for _, data in frames[:-1]]


def tokenize(base_url: str, body: dict) -> list[int]:
    reply = http("POST", f"{base_url}/tokenize", json=body)
    assert reply.status == 200, reply.body
    return reply.json()["tokens"]


def content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


# ---------------------------------------------------------------- chat template flags
def test_continue_final_message_continues_the_partial_answer(base_url: str, engine: AsyncEngine):
    out = post(
        base_url, "chat/completions", {"messages": PREFILLED, **CONTINUE, "return_token_ids": True}
    )
    prompt_ids = out["prompt_token_ids"]
    assert prompt_ids == tokenize(base_url, {"messages": PREFILLED, **CONTINUE})
    tok = engine.tokenizer
    assert tok.decode(prompt_ids).endswith(f"assistant\n{PARTIAL}")  # open, no end of turn
    assert tok.convert_tokens_to_ids("<|im_end|>") != prompt_ids[-1]
    [choice] = out["choices"]
    assert choice["message"]["role"] == "assistant"
    # the model ran exactly that prompt: completions on the same ids agree
    same = post(base_url, "completions", {"prompt": prompt_ids})
    assert choice["message"]["content"] == same["choices"][0]["text"]
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)


def test_without_the_generation_prompt_the_user_turn_is_continued(base_url: str):
    flags = {"add_generation_prompt": False}
    out = post(
        base_url, "chat/completions", {"messages": QUESTION, **flags, "return_token_ids": True}
    )
    assert out["prompt_token_ids"] == tokenize(base_url, {"messages": QUESTION, **flags})
    assert out["prompt_token_ids"] != tokenize(base_url, {"messages": QUESTION})
    assert out["choices"][0]["message"]["role"] == "user"  # vLLM's: the last message's role


@pytest.mark.parametrize("path", ["chat/completions", "tokenize"])
def test_both_template_flags_are_a_400(base_url: str, path: str):
    body = {"messages": PREFILLED, "add_generation_prompt": True, "continue_final_message": True}
    prefix = "/v1/" if path != "tokenize" else "/"
    reply = http("POST", f"{base_url}{prefix}{path}", json=body)
    assert_error(reply, 400, param="continue_final_message")


# ---------------------------------------------------------------- chat echo
def test_echo_prefixes_the_continued_message(base_url: str):
    body = {"messages": PREFILLED, **CONTINUE}
    plain = post(base_url, "chat/completions", body)["choices"][0]["message"]["content"]
    echoed = post(base_url, "chat/completions", {**body, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == PARTIAL + plain
    chunks = stream(base_url, "chat/completions", {**body, "echo": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": PARTIAL}  # the echo comes first
    assert content(chunks) == PARTIAL + plain


def test_echo_needs_the_reply_to_continue_the_last_role(base_url: str):
    # with the generation prompt the reply is a new assistant turn: a user message is not
    # echoed (vLLM's rule); without it the reply continues the user's turn, echoed
    plain = post(base_url, "chat/completions", {"messages": QUESTION})
    echoed = post(base_url, "chat/completions", {"messages": QUESTION, "echo": True})
    assert echoed["choices"][0]["message"] == plain["choices"][0]["message"]
    body = {"messages": QUESTION, "add_generation_prompt": False}
    continued = post(base_url, "chat/completions", body)["choices"][0]["message"]["content"]
    out = post(base_url, "chat/completions", {**body, "echo": True})
    assert out["choices"][0]["message"]["content"] == QUESTION[0]["content"] + continued


# ---------------------------------------------------------------- return_token_ids
def test_chat_token_ids_match_the_content_and_the_logprobs(base_url: str, engine: AsyncEngine):
    body = {"messages": QUESTION, "return_token_ids": True, "logprobs": True}
    out = post(base_url, "chat/completions", body)
    [choice] = out["choices"]
    ids = choice["token_ids"]
    tok = engine.tokenizer
    assert tok.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    assert [tok.decode([t]) for t in ids] == [lp["token"] for lp in choice["logprobs"]["content"]]
    assert len(ids) == out["usage"]["completion_tokens"]
    assert out["prompt_token_ids"] == tokenize(base_url, {"messages": QUESTION})
    assert "prompt_token_ids" not in choice  # chat: on the object, as in vLLM
    plain = post(base_url, "chat/completions", {"messages": QUESTION})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("echo", [False, True])
def test_completion_token_ids_match_the_text(base_url: str, engine: AsyncEngine, echo: bool):
    body = {"prompt": PROMPT, "return_token_ids": True, "logprobs": 1, "echo": echo}
    [choice] = post(base_url, "completions", body)["choices"]
    tok = engine.tokenizer
    assert choice["prompt_token_ids"] == engine.tokenize(PROMPT)
    ids = choice["token_ids"]  # the generated ones only, echo or not (vLLM's)
    assert (PROMPT if echo else "") + tok.decode(ids, skip_special_tokens=True) == choice["text"]
    generated = choice["logprobs"]["tokens"][len(choice["prompt_token_ids"]) if echo else 0 :]
    assert generated == [tok.decode([t]) for t in ids]


def test_chat_stream_token_ids_join_to_the_whole(base_url: str):
    body = {"messages": QUESTION, "return_token_ids": True, "n": 2, "stop": [NEVER_STOP]}
    whole = post(base_url, "chat/completions", body)
    chunks = stream(base_url, "chat/completions", body)
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == whole["prompt_token_ids"]  # its first chunk only
        assert all("prompt_token_ids" not in c for c in mine[1:])
        joined = [t for c in mine for t in c["choices"][0]["token_ids"]]  # on every chunk
        assert joined == whole["choices"][index]["token_ids"]
        assert content(mine) == whole["choices"][index]["message"]["content"]


@pytest.mark.parametrize("echo", [False, True])
def test_completion_stream_token_ids_join_to_the_whole(base_url: str, echo: bool):
    body = {"prompt": PROMPT, "return_token_ids": True, "echo": echo, "stop": [NEVER_STOP]}
    [whole] = post(base_url, "completions", body)["choices"]
    chunks = [c["choices"][0] for c in stream(base_url, "completions", body)]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    if echo:
        assert chunks[0]["text"] == PROMPT and chunks[0]["token_ids"] == []
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


# ---------------------------------------------------------------- continuous usage
@pytest.mark.parametrize(
    "path, body",
    [
        ("chat/completions", {"messages": QUESTION}),
        ("completions", {"prompt": [PROMPT, "Once upon a time"], "n": 2}),
    ],
)
@pytest.mark.parametrize("include_usage", [True, None])
def test_continuous_usage_counts_each_chunk(
    base_url: str, path: str, body: dict, include_usage: bool | None
):
    options = {"continuous_usage_stats": True}
    if include_usage is not None:
        options["include_usage"] = include_usage  # left out: true, as in vLLM
    body = {**body, "return_token_ids": True, "stop": [NEVER_STOP], "ignore_eos": True}
    chunks = stream(base_url, path, {**body, "stream_options": options})
    *body_chunks, last = chunks
    assert last["choices"] == []  # the usage chunk still ends the stream
    final = last["usage"]
    whole = post(base_url, path, body)["usage"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached ones may differ
    assert [final[k] for k in counts] == [whole[k] for k in counts]
    so_far = 0
    for chunk in body_chunks:
        usage = chunk["usage"]
        so_far += len(chunk["choices"][0]["token_ids"])
        assert usage["completion_tokens"] == so_far
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + so_far
    assert so_far == final["completion_tokens"]


def test_continuous_usage_without_include_usage_is_a_400(base_url: str):
    options = {"include_usage": False, "continuous_usage_stats": True}
    body = {**GREEDY, "prompt": PROMPT, "stream": True, "stream_options": options}
    reply = http("POST", f"{base_url}/v1/completions", json=body)
    assert_error(reply, 400, param="stream_options.continuous_usage_stats")


# ---------------------------------------------------------------- return_tokens_as_token_ids
def token_id(name: str) -> int:
    prefix, _, digits = name.partition(":")
    assert prefix == "token_id" and digits.isdecimal(), name
    return int(digits)


def test_chat_logprob_tokens_as_token_ids(base_url: str, engine: AsyncEngine):
    body = {"messages": QUESTION, "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    text = post(base_url, "chat/completions", body)["choices"][0]
    ids = post(base_url, "chat/completions", {**body, "return_tokens_as_token_ids": True})
    [choice] = ids["choices"]
    entries = choice["logprobs"]["content"]
    assert [token_id(e["token"]) for e in entries] == choice["token_ids"]
    tok = engine.tokenizer
    for entry, plain in zip(entries, text["logprobs"]["content"], strict=True):
        assert entry["logprob"] == plain["logprob"]
        assert entry["bytes"] == plain["bytes"]  # the token text's bytes, as before
        alternatives = [token_id(t["token"]) for t in entry["top_logprobs"]]
        assert [tok.decode([t]) for t in alternatives] == [
            t["token"] for t in plain["top_logprobs"]
        ]


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprob_tokens_as_token_ids(base_url: str, engine: AsyncEngine, echo: bool):
    body = {"prompt": PROMPT, "logprobs": 2, "echo": echo, "return_token_ids": True}
    [text] = post(base_url, "completions", body)["choices"]
    [ids] = post(base_url, "completions", {**body, "return_tokens_as_token_ids": True})["choices"]
    logprobs = ids["logprobs"]
    expected = (ids["prompt_token_ids"] if echo else []) + ids["token_ids"]
    assert [token_id(t) for t in logprobs["tokens"]] == expected
    tok = engine.tokenizer
    for top, plain in zip(logprobs["top_logprobs"], text["logprobs"]["top_logprobs"], strict=True):
        if top is None:  # the first echoed prompt token
            assert plain is None
            continue
        assert {tok.decode([token_id(t)]): v for t, v in top.items()} == plain
    assert logprobs["text_offset"] == text["logprobs"]["text_offset"]  # offsets of the text


# ---------------------------------------------------------------- include_stop_str_in_output
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_include_stop_str_in_output(base_url: str, path: str, streamed: bool):
    head = {"messages": QUESTION} if path == "chat/completions" else {"prompt": PROMPT}

    def text(body: dict) -> tuple[str, str]:
        if streamed:
            chunks = [c for c in stream(base_url, path, body) if c["choices"]]
            joined = (
                content(chunks)
                if path == "chat/completions"
                else "".join(c["choices"][0]["text"] for c in chunks)
            )
            finish = [c["choices"][0]["finish_reason"] for c in chunks][-1]
            return joined, finish
        [choice] = post(base_url, path, body)["choices"]
        got = choice["message"]["content"] if path == "chat/completions" else choice["text"]
        return got, choice["finish_reason"]

    free, _ = text({**head, "ignore_eos": True})
    stop = free.split()[1]  # a word in the middle of what the model says
    at = free.index(stop)
    assert text({**head, "ignore_eos": True, "stop": [stop]}) == (free[:at], "stop")
    kept = text({**head, "ignore_eos": True, "stop": [stop], "include_stop_str_in_output": True})
    assert kept == (free[: at + len(stop)], "stop")
