"""Prompts to token ids: plain prompts through the engine's tokenizer, conversations through
the tokenizer's chat template.

Both run in one worker thread (``TOKENIZER_POOL``), never on the event loop: a 1 MiB prompt
takes the tokenizer about a second, and ``/health`` and every stream would wait that long. A
text longer than ``max_chars`` characters is refused before any of that: no token is longer
than the vocabulary's longest token string, so such a text cannot fit the context anyway.

Message content is a string or a list of text parts; the parts' texts are joined with newlines
(as vLLM does). Image parts become the model's image marker text before the template runs
(server/media/images.py); ``chat_prompt`` then hands the rendered text and the decoded images
to the model's processor. The ``developer`` role is the newer name of ``system``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TypeVar

import jinja2
import jinja2.defaults

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.server.media.images import as_template_parts, loops_over_content
from paged_serve.server.protocol.common import ContentPart
from paged_serve.server.protocol.errors import bad_request

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = {"text", "input_text", "output_text"}


# One thread: tokenizing is CPU work on a 2-core box, and one at a time keeps a burst of huge
# prompts from taking the engine's cores too.
TOKENIZER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
T = TypeVar("T")


async def off_loop(work: Callable[[], T]) -> T:
    """``work()`` in the tokenizer thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(TOKENIZER_POOL, work)


@cache
def _longest_token_chars(tokenizer: object) -> int:
    """Characters in the vocabulary's longest token string (its decoded text is no longer)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)  # type: ignore[attr-defined]


def max_chars(engine: AsyncEngine) -> int | None:
    """The most characters a text can have and still fit the context (None: no tokenizer)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    return _longest_token_chars(tokenizer) * engine.max_model_len


def check_text_length(engine: AsyncEngine, chars: int, param: str) -> None:
    """400 (``context_length_exceeded``) for a text too long to fit however it tokenizes."""
    limit = max_chars(engine)
    if limit is not None and chars > limit:
        raise bad_request(
            f"the text has {chars} characters; this model's context of {engine.max_model_len} "
            f"tokens holds at most {limit} (its longest token is "
            f"{limit // engine.max_model_len} characters)",
            param,
            "context_length_exceeded",
        )


async def tokenize_prompt(
    engine: AsyncEngine, prompt: str | Sequence[int], param: str
) -> list[int]:
    """Token ids of a completions prompt, tokenized off the event loop; bad ids, a missing
    tokenizer or a text that cannot fit the context -> 400."""
    if isinstance(prompt, str):
        check_text_length(engine, len(prompt), param)
    try:
        return await off_loop(lambda: engine.tokenize(prompt))
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def message_text(content: str | list[ContentPart] | None, param: str) -> str:
    """The text of a message's content (None counts as empty, as for assistant tool calls)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(
                f"content part type {part.type!r} is not supported (text parts only)",
                f"{param}[{i}]",
            )
        texts.append(part.text)
    return "\n".join(texts)


def chat_message(role: str, content: str | list[ContentPart] | None, param: str) -> dict:
    """A ``{"role", "content"}`` dict for the chat template; unknown roles -> 400."""
    if role not in ROLES:
        raise bad_request(
            f"role {role!r} is not supported; use one of {sorted(ROLES)}", f"{param}.role"
        )
    return {"role": ROLES[role], "content": message_text(content, f"{param}.content")}


# Names chat_template_kwargs may not set. A kwarg becomes a template variable, and a variable
# shadows the template environment's global of the same name: {"strftime_now": null} breaks
# every template that dates its system prompt (Llama 3.x), {"raise_exception": ...} silences a
# template's own validation. So: apply_chat_template's parameters (transformers 5.x; one of them,
# sanitize_control_tokens, guards against control tokens in message text), what
# render_jinja_template passes the template itself, the globals transformers' chat-template
# environment adds (transformers.utils.chat_template_utils._compile_jinja_template), and Jinja's
# own default globals.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        # apply_chat_template's parameters
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        # the template's render arguments
        "messages",
        # the chat-template environment's globals
        "raise_exception",
        "strftime_now",
        *jinja2.defaults.DEFAULT_NAMESPACE,  # range, dict, namespace, lipsum, cycler, joiner
    }
)


class _TemplateFailed(Exception):
    """The chat template raised while rendering (carries what it raised)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


async def chat_prompt(
    engine: AsyncEngine,
    messages: list[dict],
    param: str,
    *,
    images: Sequence[object] = (),
    image_marker: str = "",
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int] | MultimodalPrompt:
    """Apply the chat template and tokenize: by default with the generation prompt, ``tools``
    if given, and the request's ``chat_template_kwargs`` as template variables (e.g. Qwen3's
    ``enable_thinking``), and without adding special tokens again (the template already has
    them); ``continue_final_message`` leaves the last message open for the model to continue.
    With ``images`` (decoded PIL images, one ``image_marker`` per image in the messages' text)
    the rendered text and the images go through the model's processor
    (``AsyncEngine.multimodal_prompt``) in the same worker thread, and a ``MultimodalPrompt``
    comes back; without, token ids. A template that reads content as a list of parts gets text
    and image parts (it writes the markers)."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs"
        )
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", param)
    check_text_length(engine, sum(len(str(m.get("content") or "")) for m in messages), param)
    extra = dict(template_kwargs or {})
    if tools is not None:
        extra["tools"] = tools
    template = tokenizer.chat_template
    if images and isinstance(template, str) and loops_over_content(template):
        messages = as_template_parts(messages, image_marker)

    def render_and_tokenize() -> list[int] | MultimodalPrompt:
        try:
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **extra,
            )
        except MemoryError:
            raise
        except Exception as exc:
            # The template runs on the request's messages and kwargs: whatever it raises
            # (raise_exception's TemplateError, a TypeError from a kwarg of the wrong type, a
            # ValueError from transformers' checks) is the request's fault, never a 500.
            raise _TemplateFailed(exc) from None
        if images:
            return engine.multimodal_prompt(text, images)
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    try:
        return await off_loop(render_and_tokenize)
    except _TemplateFailed as failed:
        exc = failed.cause
        what = str(exc) if isinstance(exc, (ValueError, jinja2.TemplateError)) else repr(exc)
        raise bad_request(f"the chat template rejected the messages: {what}", param) from None
    except InvalidRequestError as exc:  # the engine's: e.g. a model that takes no images
        raise bad_request(str(exc), param) from None
    except ValueError as exc:  # tokenizing the rendered text, or its images' markers
        raise bad_request(f"the rendered conversation did not tokenize: {exc}", param) from None
