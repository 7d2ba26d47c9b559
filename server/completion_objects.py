"""The completions and chat completions objects, whole and as stream chunks.

Both are a list of choices in one envelope::

    {"id", "object", "created", "model", "choices": [...], "system_fingerprint": null, "usage"}

``usage`` (with ``prompt_tokens_details.cached_tokens``) is always there on a whole object. On
a stream chunk it is ``null`` with ``stream_options.include_usage`` (the last chunk, with
``"choices": []``, carries it), the usage so far with vLLM's ``continuous_usage_stats``, and
absent otherwise. A completions stream sends ``text_completion`` objects with one choice each;
a chat stream sends ``chat.completion.chunk`` objects whose choices carry a ``delta``.

vLLM's ``return_token_ids`` adds ``token_ids`` (the completion's, or in a stream the chunk's
new ones) to every choice, and ``prompt_token_ids``: on each completions choice (in a stream,
its first chunk), on the chat object (in a stream, each choice's first chunk), where vLLM
puts them.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from paged_serve.server.logprobs import ChatLogprobs, CompletionLogprobs, PromptLogprobs

ChoiceT = TypeVar("ChoiceT")


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


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked
    prompt_token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids
    token_ids: list[int] | UnsetType = UNSET


class Completion(ChoiceList[CompletionChoice], kw_only=True):
    """A whole completion, and each chunk of a completions stream."""

    object: str = "text_completion"


class AssistantMessage(msgspec.Struct, kw_only=True):
    """``content`` is null for a reply that is only tool calls. ``role`` is another only when
    the reply continues a last message of that role (vLLM's ``add_generation_prompt`` false)."""

    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | None | UnsetType = UNSET  # vLLM's, with --reasoning-parser


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids


class ChatCompletion(ChoiceList[ChatChoice], kw_only=True):
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked
    prompt_token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids


class ChatDelta(msgspec.Struct, kw_only=True):
    """What a chunk adds to its choice; ``{}`` on a last chunk that only finishes it."""

    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids: this chunk's new ids


class ChatCompletionChunk(ChoiceList[ChatChunkChoice], kw_only=True):
    object: str = "chat.completion.chunk"
    prompt_token_ids: list[int] | UnsetType = UNSET  # on each choice's first chunk


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class FunctionDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(msgspec.Struct, kw_only=True):
    """A streamed call: the first delta of a call has its id and name, later ones argument
    fragments (the concatenation is the arguments' JSON text)."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionDelta
