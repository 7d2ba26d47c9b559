"""What several endpoints' objects share: the envelope of completions and chat replies with
its ``usage``, and a message's content parts (chat messages, Responses input items).

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

ChoiceT = TypeVar("ChoiceT")


class ContentPart(msgspec.Struct, kw_only=True):
    """A message content part; only text parts are supported."""

    type: str
    text: str | None = None


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
