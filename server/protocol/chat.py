"""``POST /v1/chat/completions``: the request with its messages, and the ``chat.completion``
object, whole and as ``chat.completion.chunk`` stream chunks (whose choices carry a ``delta``).

vLLM's ``return_token_ids`` adds ``token_ids`` (the completion's, or in a stream the chunk's new
ones) to every choice, and ``prompt_token_ids`` to the object (in a stream, each choice's first
chunk), where vLLM puts them. Field names follow the OpenAI API reference (plus vLLM's extras,
``SamplingFields``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from paged_serve.server.protocol.common import ChoiceList, ContentPart
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import ChatTopLogprobCount, PositiveInt
from paged_serve.server.protocol.logprobs import ChatLogprobs, PromptLogprobs
from paged_serve.server.protocol.sampling import SamplingFields
from paged_serve.server.protocol.tools import (
    MessageToolCall,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
)


def check_template_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """400 for both flags at once: a new turn cannot also continue the last message (vLLM's
    rule, for chat completions and /tokenize alike)."""
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message needs add_generation_prompt set to false",
            "continue_final_message",
        )


class ChatMessage(msgspec.Struct, kw_only=True):
    """``tool_calls`` on assistant messages; ``tool_call_id`` on ``tool`` messages."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. vLLM's template flags: ``add_generation_prompt`` (open
    a new assistant turn) and ``continue_final_message`` (leave the last message open, to be
    continued); ``echo`` puts the last message's text in front of the reply when the reply
    continues that message's role."""

    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: ChatTopLogprobCount | None = None
    tools: list[ToolSpec] | None = None  # server.tools.planning
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)
        self.echo = bool(self.echo)
        self.add_generation_prompt = self.add_generation_prompt is not False
        self.continue_final_message = bool(self.continue_final_message)

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        self.check_sampling()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        check_template_flags(self.add_generation_prompt, self.continue_final_message)

    @property
    def reply_role(self) -> str:
        """The reply's role, as vLLM has it: a new assistant turn with the generation prompt,
        else a continuation of the last message, in its role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


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
