"""What several endpoints' objects share: the envelope of completions and chat replies with
its ``usage``, a message's content parts (chat messages, Responses input items: text and
images), and the prompt list completions and the pooling endpoints take (``prompt_list``).

Completions and chat replies are a list of choices in one envelope::

    {"id", "object", "created", "model", "choices": [...], "system_fingerprint": null, "usage"}

``usage`` (with ``prompt_tokens_details.cached_tokens``) is always there on a whole object. On
a stream chunk it is ``null`` with ``stream_options.include_usage`` (the last chunk, with
``"choices": []``, carries it), the usage so far with vLLM's ``continuous_usage_stats``, and
absent otherwise.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from paged_serve.server.protocol.errors import bad_request

ChoiceT = TypeVar("ChoiceT")


class ImageURL(msgspec.Struct, kw_only=True):
    """A chat ``image_url`` part's object; ``detail`` is accepted and ignored (as vLLM)."""

    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """A message content part: text (``text``, ``input_text``, ``output_text``) or an image
    (chat's ``image_url`` part holds an ``ImageURL``; Responses' ``input_image`` a URL
    string). Other types decode too, to be refused by name (server/media/images.py)."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    detail: str | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct, kw_only=True):
    """Prompt tokens count once per prompt (not once per sample); completion tokens add up
    over every choice; cached tokens count once per prompt, like prompt tokens."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChoiceList(msgspec.Struct, Generic[ChoiceT], kw_only=True):
    """The envelope; each subclass fixes ``object`` and the choice type."""

    id: str
    object: str
    created: int  # Unix seconds, the same for every chunk of a stream
    model: str
    choices: list[ChoiceT]
    system_fingerprint: None = None
    usage: Usage | None | UnsetType = UNSET


def prompt_list(value: str | list[str | int | list[int]], param: str) -> list[str | list[int]]:
    """``value`` (completions' ``prompt``, a pooling request's ``input``) as a list of texts or
    token-id lists; 400 naming ``param`` for an empty or mixed list."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, int) for p in value):
        return [list(value)]
    if all(isinstance(p, list) for p in value):
        if any(not p for p in value):
            raise bad_request("a token-id prompt must not be empty", param)
        return list(value)
    raise bad_request(
        f"{param} must be a string, a list of strings, a list of token ids "
        "or a list of token-id lists",
        param,
    )
