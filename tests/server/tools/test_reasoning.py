"""``--reasoning-parser qwen3``: the ``<think>`` block goes to ``reasoning_content``, whole and
streamed (split at every character), and ``chat_template_kwargs`` reach the template."""

from __future__ import annotations

import json

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.app import create_app
from paged_serve.server.tools.reasoning import Qwen3ReasoningParser, ReasoningStream
from tests.server.conftest import ServerThread, assert_error, http

# (prompt tail, reply, reasoning, content)
FIXTURES = [
    (
        "<|im_start|>assistant\n",
        "<think>\nAdd 2 and 2.\n</think>\n\nIt is 4.",
        "Add 2 and 2.",
        "It is 4.",
    ),
    ("<|im_start|>assistant\n", "No thinking < here", "", "No thinking < here"),
    (
        "<|im_start|>assistant\n<think>\n",
        "Opened by the template.</think>Done",
        "Opened by the template.",
        "Done",
    ),
    ("<|im_start|>assistant\n", "<think>cut off by max_tok", "cut off by max_tok", ""),
    ("x", "<think></think>\n\nEmpty thoughts", "", "Empty thoughts"),
]


@pytest.mark.parametrize(("prompt", "text", "reasoning", "content"), FIXTURES)
def test_split_whole_and_streamed(prompt: str, text: str, reasoning: str, content: str):
    parser = Qwen3ReasoningParser(prompt)
    whole = parser.split(text, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    stream = ReasoningStream(parser)
    got_reasoning = got_content = ""
    for i, char in enumerate(text):
        delta = stream.feed(char, final=i == len(text) - 1)
        assert "</" not in delta.reasoning and "<think" not in delta.content
        got_reasoning += delta.reasoning
        got_content += delta.content
    assert (got_reasoning, got_content) == (reasoning, content)


@pytest.fixture(scope="module")
def reasoning_client(engine: AsyncEngine, server_thread: ServerThread) -> openai.OpenAI:
    url = server_thread.serve(lambda: create_app(engine, reasoning_parser="qwen3"))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


# SmolLM2 does not think: a regex shapes its reply like a thinking model's.
THINKING = {"structured_outputs": {"regex": "<think>[a-z ]{5,20}</think>[A-Z][a-z ]{5,20}"}}


def test_reasoning_content_whole_and_streamed(reasoning_client: openai.OpenAI, model_name: str):
    kw = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": THINKING,
    }
    message = reasoning_client.chat.completions.create(**kw).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in message.content
    chunks = reasoning_client.chat.completions.create(stream=True, **kw)
    streamed_reasoning = streamed_content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)


def test_chat_template_kwargs(base_url: str):
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert http("POST", f"{base_url}/v1/chat/completions", json=body).status == 200
    body["chat_template_kwargs"] = {"tokenize": True}
    reply = http("POST", f"{base_url}/v1/chat/completions", json=body)
    assert "tokenize" in json.dumps(assert_error(reply, 400, param="chat_template_kwargs"))


class OneTokenThink:
    """A tokenizer stand-in where </think> is one added token, as in Qwen3's."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        class Encoded:
            input_ids = [151668] if text == "</think>" else [1, 2, 3]

        return Encoded()


def test_grammar_applies_after_the_reasoning(default_tokenizer):
    assert Qwen3ReasoningParser("assistant\n").grammar_after(OneTokenThink()) == 151668
    # the template closed the block (enable_thinking false): the grammar holds from the start
    closed = Qwen3ReasoningParser("assistant\n<think>\n\n</think>\n\n")
    assert closed.grammar_after(OneTokenThink()) is None
    # </think> is several tokens for SmolLM2: no token to wait for
    assert Qwen3ReasoningParser("assistant\n").grammar_after(default_tokenizer) is None
