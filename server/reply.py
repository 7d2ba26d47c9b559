"""What a completions or chat reply carries in every object it sends: id, time, model, usage.

``ChoiceReply`` is the base of the two endpoints' reply builders (``CompletionReply``,
``ChatReply``): it wraps their choices in the envelope of ``server.completion_objects`` and
decides where ``usage`` goes in a stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

from msgspec import UNSET

from server.completion_objects import ChoiceList, PromptTokensDetails, Usage
from server.generation import Generation
from server.sse import frame
from server.state import ServerState

ReplyT = TypeVar("ReplyT", bound=ChoiceList)


class ChoiceReply:
    """One reply's identity, and its choices wrapped as OpenAI objects."""

    def __init__(
        self, state: ServerState, reply_id: str, prompt_tokens: int, *, include_usage: bool
    ):
        self.state = state
        self.id = reply_id
        self.created = int(time.time())  # Unix seconds, the same for every chunk of a stream
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage  # a stream ends with a usage chunk

    def whole(self, kind: type[ReplyT], choices: Sequence, generation: Generation) -> ReplyT:
        """The whole (non-streamed) object, with its usage."""
        return self._wrap(kind, list(choices), self.usage(generation))

    def chunk(self, kind: type[ReplyT], choice: object) -> bytes:
        """A stream frame with one choice; ``usage`` null if a usage chunk will follow."""
        return frame(self._wrap(kind, [choice], None if self.include_usage else UNSET))

    def usage_chunk(self, kind: type[ReplyT], generation: Generation) -> bytes:
        """The stream's last frame: no choices, the usage."""
        return frame(self._wrap(kind, [], self.usage(generation)))

    def usage(self, generation: Generation) -> Usage:
        completion = generation.completion_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.cached_tokens),
        )

    def _wrap(self, kind: type[ReplyT], choices: list, usage: object) -> ReplyT:
        return kind(
            id=self.id,
            created=self.created,
            model=self.state.served_model_name,
            choices=choices,
            usage=usage,
        )
