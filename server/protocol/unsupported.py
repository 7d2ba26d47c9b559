"""Request fields that OpenAI's or vLLM's chat, completions or Responses protocol documents but
this server does not implement: set to anything but a value that means "not used", each is a
400 naming the field, so no client gets a reply that silently ignored what it asked for.

The table is data: ``CHAT_REFUSED``, ``COMPLETION_REFUSED`` and ``RESPONSES_REFUSED`` map each
endpoint's refused fields to a ``Refused`` (the values that mean "not used": the default,
``null``, and the empty value a client sends to mean the same) and say why. ``IGNORED_BY_SPEC``
lists the fields OpenAI documents as hints a server may ignore (accepted, unused). Any other
unknown name is ignored, as OpenAI does (msgspec skips it).

The request Structs hold only fields that do something. A body is decoded once, into
``refusing(struct, table)``: the request Struct with one more field per refused name (any JSON
value, ``UNSET`` when absent), which ``refuse_unsupported`` then reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET

from paged_serve.server.protocol.errors import bad_request

StructT = TypeVar("StructT", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class Refused:
    """A field this server refuses: ``unused`` are the values accepted as "not used" (``null``
    always is); ``why`` finishes the 400's sentence."""

    unused: tuple[object, ...]
    why: str


_NO_BEAM = "beam search is not implemented"
_NO_MEDIA = "replies are text; inputs are text and images (image_url content parts)"
_PROCESSOR_AS_SAVED = "images go through the model's processor with its saved settings"

# vLLM's extras that both of its endpoints take (its SamplingParams and request extras).
_SHARED: dict[str, Refused] = {
    "use_beam_search": Refused((False,), _NO_BEAM),
    "length_penalty": Refused((1.0,), f"it only applies to beam search, and {_NO_BEAM}"),
    "allowed_token_ids": Refused(([],), "use logit_bias to favour or ban tokens"),
    "bad_words": Refused(([],), "use logit_bias to ban tokens"),
    "truncate_prompt_tokens": Refused((), "prompts are never truncated: shorten the prompt"),
    "spaces_between_special_tokens": Refused(
        (True,), "special tokens are always decoded with spaces between them"
    ),
    "logits_processors": Refused(([],), "custom logits processors are not loaded"),
    "priority": Refused((0,), "requests are scheduled first come, first served"),
    "request_id": Refused((), "the server names each request itself"),
    "kv_transfer_params": Refused(({},), "disaggregated serving is not implemented"),
    "vllm_xargs": Refused(({},), "there are no extensions to pass arguments to"),
    "repetition_detection": Refused(({},), "use repetition_penalty or frequency_penalty"),
    "structural_tag": Refused((), "use structured_outputs, guided_* or response_format"),
    "guided_decoding_backend": Refused((), "the grammar backend is fixed"),
    "guided_whitespace_pattern": Refused((), "JSON whitespace follows the grammar backend"),
}

CHAT_REFUSED: dict[str, Refused] = {
    # OpenAI's
    "audio": Refused((), _NO_MEDIA),
    "modalities": Refused((["text"],), _NO_MEDIA),
    "prediction": Refused((), "predicted outputs are not implemented"),
    "web_search_options": Refused((), "there is no web search"),
    "functions": Refused(([],), "use tools (the legacy functions API is not mapped)"),
    "function_call": Refused(("none",), "use tool_choice (the legacy functions API is not mapped)"),
    "reasoning_effort": Refused((), "reasoning is whatever the model and chat template do"),
    "verbosity": Refused(("medium",), "there is no verbosity control"),
    "store": Refused((False,), "chat completions are not stored; use /v1/responses"),
    # vLLM's
    "add_special_tokens": Refused(
        (False,), "the chat template's special tokens are the ones the prompt gets"
    ),
    "documents": Refused(([],), "documents are not passed to the chat template"),
    "chat_template": Refused(
        (), "the server's chat template is used (the model's, or --chat-template)"
    ),
    "media_io_kwargs": Refused(({},), _PROCESSOR_AS_SAVED),
    "mm_processor_kwargs": Refused(({},), _PROCESSOR_AS_SAVED),
    "include_reasoning": Refused((True,), "reasoning_content is always returned"),
    **_SHARED,
}

COMPLETION_REFUSED: dict[str, Refused] = {
    # OpenAI's
    "suffix": Refused(("",), "insertion (fill in the middle) is not implemented"),
    # vLLM's
    "add_special_tokens": Refused(
        (True,), "a text prompt always gets the tokenizer's special tokens"
    ),
    "prompt_embeds": Refused((), "prompts are text or token ids"),
    **_SHARED,
}

RESPONSES_REFUSED: dict[str, Refused] = {
    "conversation": Refused((), "use previous_response_id"),
    "prompt": Refused((), "prompt templates are not stored here: send instructions and input"),
    "reasoning": Refused(({},), "reasoning effort and summaries are not steered"),
    "truncation": Refused(("disabled",), "a prompt too long for the context is a 400"),
    "moderation": Refused((), "there is no moderation model"),
    "context_management": Refused(([],), "there is no compaction"),
}

# OpenAI documents these as hints (caching, routing, abuse monitoring, stored-object labels) a
# server may ignore: accepted and unused. ``metadata`` only labels a stored completion, and
# ``store: true`` is refused.
IGNORED_BY_SPEC = (
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "metadata",
)


def refusing(struct: type[StructT], table: dict[str, Refused]) -> type[StructT]:
    """``struct`` with a field for each name of ``table`` (any JSON value; absent: UNSET): one
    decode into it gives the request and what ``refuse_unsupported`` reads."""
    return _refusing(struct, tuple(table))


@cache
def _refusing(struct: type[StructT], names: tuple[str, ...]) -> type[StructT]:
    served = set(names) & set(struct.__struct_fields__)
    if served:
        raise ValueError(f"{struct.__name__} serves {sorted(served)}: they cannot be refused")
    return msgspec.defstruct(
        struct.__name__,
        [(name, Any, UNSET) for name in names],
        bases=(struct,),
        module=struct.__module__,
        kw_only=True,
    )


def refuse_unsupported(body: msgspec.Struct, table: dict[str, Refused]) -> None:
    """Raise APIError (400, param = the field) for the first field of ``table`` that ``body``
    (decoded into ``refusing(type, table)``) sets to a value other than null or one of its
    ``unused`` values."""
    for name, refused in table.items():
        value = getattr(body, name)
        if value is UNSET or value is None or _is_unused(value, refused.unused):
            continue
        unused = " or ".join(["null", *(msgspec.json.encode(v).decode() for v in refused.unused)])
        raise bad_request(
            f"this server does not implement {name}: {refused.why} (leave it out or set it to "
            f"{unused})",
            name,
        )


def _is_unused(value: object, unused: tuple[object, ...]) -> bool:
    # type-exact, so true is not 1 and 0 is not false (but 1 and 1.0 are both numbers); an
    # object whose every field is null (``"reasoning": {"effort": null}``) says nothing either
    if isinstance(value, dict) and all(v is None for v in value.values()):
        value = {}
    return any(_same(value, u) for u in unused)


def _same(value: object, unused: object) -> bool:
    if isinstance(unused, bool) or isinstance(value, bool):
        return type(value) is type(unused) and value == unused
    if isinstance(unused, (int, float)):
        return isinstance(value, (int, float)) and value == unused
    return type(value) is type(unused) and value == unused
