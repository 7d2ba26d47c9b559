"""``chat_template_kwargs`` may set the template's own variables, never the names the template
environment or the renderer define (a 400 naming ``chat_template_kwargs``), and whatever a
template raises while rendering a request is that request's 400, never a 500."""

from __future__ import annotations

import inspect

import pytest
import transformers
from transformers.utils.chat_template_utils import _compile_jinja_template

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.server.generation.prompts import RESERVED_TEMPLATE_KWARGS
from tests.server.conftest import assert_error, http

# What Llama 3.x templates do with the date, a check of the messages that raises, and a
# variable of the template's own that a request may set.
TEMPLATE = (
    "{%- if strftime_now is defined %}{%- set date = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date = '26 Jul 2024' %}{%- endif %}"
    "<|im_start|>system\nToday is {{ date }}.{{ ' Hi!' * (greetings + 0) }}<|im_end|>\n"
    "{%- for m in messages %}"
    "{%- if not m.content %}{{ raise_exception('Empty ' + m.role + ' message') }}{%- endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LEAKS = ("Traceback", 'File "', ".py")


@pytest.fixture
def dated_template(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE)


def _chat(base_url: str, kwargs: dict) -> object:
    body = {
        "messages": [{"role": "user", "content": "What day is it?"}],
        "max_tokens": 1,
        "temperature": 0,
        "chat_template_kwargs": kwargs,
    }
    return http("POST", f"{base_url}/v1/chat/completions", json=body)


def test_the_templates_own_variables_are_served(base_url: str, dated_template: None):
    assert _chat(base_url, {"greetings": 2}).status == 200


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strftime_now": "x"},
        {"strftime_now": None},
        {"raise_exception": "x"},
        {"range": 3},
        {"namespace": {}},
        {"messages": []},
        {"add_generation_prompt": False},
        {"sanitize_control_tokens": False},
    ],
    ids=lambda kwargs: next(iter(kwargs)),
)
def test_a_template_global_or_render_argument_is_refused(
    base_url: str, dated_template: None, kwargs: dict
):
    reply = _chat(base_url, {"greetings": 1, **kwargs})
    error = assert_error(reply, 400, param="chat_template_kwargs")
    assert repr(next(iter(kwargs))) in error["message"]


@pytest.mark.parametrize(
    "kwargs, messages",
    [
        ({"greetings": "many"}, [{"role": "user", "content": "Hi"}]),  # a TypeError inside
        ({"greetings": 1}, [{"role": "user", "content": ""}]),
    ],
    ids=["type-error", "raise-exception"],
)
def test_a_template_that_fails_to_render_is_the_requests_400(
    base_url: str, dated_template: None, kwargs: dict, messages: list
):
    body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": kwargs}
    reply = http("POST", f"{base_url}/v1/chat/completions", json=body)
    error = assert_error(reply, 400, param="messages")
    assert error["message"].startswith("the chat template rejected the messages")
    assert not any(leak in reply.body.decode() for leak in LEAKS)
    assert _chat(base_url, {"greetings": 0}).status == 200  # the next request is served


def test_the_reserved_names_cover_the_template_environment_and_the_renderer():
    """If transformers adds a global or a parameter, this says so."""
    env_globals = set(_compile_jinja_template("x").environment.globals)
    assert env_globals <= RESERVED_TEMPLATE_KWARGS
    signature = inspect.signature(transformers.PreTrainedTokenizerBase.apply_chat_template)
    parameters = set(signature.parameters) - {"self", "kwargs"}
    assert parameters <= RESERVED_TEMPLATE_KWARGS
