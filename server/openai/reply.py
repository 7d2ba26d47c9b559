"""What a completions or chat reply carries in every object it sends: id, time, model, usage,
and the options both endpoints share about what their outputs hold.

``ChoiceReply`` is the base of the two endpoints' reply builders (``CompletionReply``,
``ChatReply``): it wraps their choices in the envelope of ``paged_serve.server.protocol.common``,
decides where ``usage`` goes in a stream, and reads the engine's outputs with vLLM's
``include_stop_str_in_output`` applied (the stop string that ended a choice appended to its
text; the detokenizer cuts the text just before it).

In a stream, a choice's new token ids wait (``hold``) until a chunk of that choice goes out and
then travel with it (``return_token_ids``), so the chunks' ids add up to the whole completion
even when an output adds ids but no text (a held-back stop-string prefix, a tool-call prefix
the parser keeps). Continuous usage counts those sent ids: each chunk's ``completion_tokens``
is the previous one's plus its own ids, and the last equals the final usage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from msgspec import UNSET

from paged_serve.engine.outputs import RequestOutput
from paged_serve.server.generation.run import Choice, Generation
from paged_serve.server.http.sse import frame
from paged_serve.server.protocol.common import ChoiceList, PromptTokensDetails, Usage
from paged_serve.server.protocol.sampling import SamplingFields
from paged_serve.server.state import ServerState

ReplyT = TypeVar("ReplyT", bound=ChoiceList)


class ChoiceReply:
    """One reply's identity, and its choices wrapped as OpenAI objects."""

    def __init__(self, state: ServerState, reply_id: str, prompt_tokens: int, body: SamplingFields):
        self.state = state
        self.id = reply_id
        self.model = state.reply_model(body.model)  # a LoRA adapter's name, as vLLM's replies
        self.created = int(time.time())  # Unix seconds, the same for every chunk of a stream
        self.prompt_tokens = prompt_tokens
        self.include_usage = body.include_usage  # a stream ends with a usage chunk
        self.continuous_usage = body.continuous_usage  # every chunk has the usage so far
        self.return_token_ids = body.return_token_ids
        self.include_stop_str = body.include_stop_str_in_output
        self._unsent: dict[int, list[int]] = {}  # per choice: ids no chunk has carried yet
        self.sent_tokens = 0  # completion token ids the stream's chunks carried so far

    async def outputs(self, generation: Generation) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``generation.outputs()``, with the stop string appended to the last text of a
        choice it ended, when asked."""
        async for index, out in generation.outputs():
            if self.include_stop_str and out.finished and isinstance(out.stop_reason, str):
                out = dataclasses.replace(out, new_text=out.new_text + out.stop_reason)
            yield index, out

    async def collect(self, generation: Generation) -> list[Choice]:
        """Every choice run to its end, in index order (``Generation.collect`` over
        ``outputs``)."""
        choices = {index: Choice(index) for index in generation.output_tokens}
        async for index, out in self.outputs(generation):
            choices[index].add(out)
        return [choices[index] for index in sorted(choices)]

    def whole(self, kind: type[ReplyT], choices: Sequence, generation: Generation) -> ReplyT:
        """The whole (non-streamed) object, with its usage."""
        return self._wrap(kind, list(choices), self.usage(generation))

    def hold(self, index: int, token_ids: list[int]) -> None:
        """Choice ``index``'s new ids, to go out with its next chunk."""
        self._unsent.setdefault(index, []).extend(token_ids)

    def chunk(
        self, kind: type[ReplyT], choice: object, generation: Generation, **fields: object
    ) -> bytes:
        """A stream frame with one choice, carrying the ids held for it; ``usage`` is the
        usage so far with continuous usage, null if a usage chunk will follow, else absent.
        ``fields`` are more envelope fields (the chat ``prompt_token_ids``)."""
        token_ids = self._unsent.pop(choice.index, [])
        self.sent_tokens += len(token_ids)
        if self.return_token_ids:
            choice.token_ids = token_ids
        if self.continuous_usage:
            usage = self._usage(self.sent_tokens, generation)
        else:
            usage = None if self.include_usage else UNSET
        return frame(self._wrap(kind, [choice], usage, **fields))

    def usage_chunk(self, kind: type[ReplyT], generation: Generation) -> bytes:
        """The stream's last frame: no choices, the usage."""
        return frame(self._wrap(kind, [], self.usage(generation)))

    def usage(self, generation: Generation) -> Usage:
        return self._usage(generation.completion_tokens, generation)

    def _usage(self, completion_tokens: int, generation: Generation) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.cached_tokens),
        )

    def _wrap(self, kind: type[ReplyT], choices: list, usage: object, **fields: object) -> ReplyT:
        return kind(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            **fields,
        )
