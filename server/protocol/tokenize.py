"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` on the wire, with vLLM's
request and response shapes."""

from __future__ import annotations

import msgspec

from paged_serve.server.protocol.chat import ChatMessage, check_template_flags
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.field_types import TokenId


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``): exactly one of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # default: True for a prompt, False for messages (the chat template has them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    return_token_strs: bool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if self.messages is not None and not self.messages:
            raise bad_request("messages must not be empty", "messages")
        check_template_flags(
            self.add_generation_prompt is not False, bool(self.continue_final_message)
        )


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # the tokenizer's own token strings, when asked


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class TokenizerInfo(msgspec.Struct, kw_only=True):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    max_model_len: int
