"""A Responses stream's events (``POST /v1/responses`` with ``stream: true``).

A stream sends typed events, each ``event: <type>`` + ``data: {..., "sequence_number": k}``
with k counting from 0: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
(repeated), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete``).
With tools, each call adds ``response.output_item.added`` (a ``function_call`` item),
``response.function_call_arguments.delta`` (repeated), ``response.function_call_arguments.done``
and ``response.output_item.done``, at its own ``output_index``.
A failure mid-stream sends an ``error`` event and ends the stream. A stored response (``store``,
default true) is stored before its last event is sent.

``ResponseStream`` numbers the events; the objects in them (the Response, its message, the
final Response that is stored) come from its ``ResponseReply``
(``paged_serve.server.responses.reply``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from paged_serve.server.generation.run import Generation
from paged_serve.server.http import sse
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.protocol.logprobs import ChatTokenLogprob
from paged_serve.server.protocol.responses import (
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    OutputItemEvent,
    OutputText,
    ResponseEvent,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from paged_serve.server.responses.reply import ResponseReply
from paged_serve.server.responses.tools import new_item_id


class ResponseStream:
    """One response's stream events as SSE frames, numbered as they are made."""

    def __init__(self, reply: ResponseReply):
        self.reply = reply
        self.sequence = 0  # the next event's sequence_number

    def frames(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        """The whole stream: parsed for calls when the reply may hold them, else plain text."""
        if self.reply.plan.parser is not None:
            return self._tool_frames(generation)
        return self._text_frames(generation)

    def frame(self, event: StreamEvent) -> bytes:
        """``event`` as the stream's next frame, numbered next (also a background run's last
        event, ``response.failed``)."""
        event.sequence_number = self.sequence
        self.sequence += 1
        return sse.frame(event, event=event.type)

    def error_frame(self, err: APIError) -> bytes:
        """The ``error`` event that ends a stream which failed midway, numbered next."""
        return self.frame(ErrorEvent(code=err.code, message=err.message, param=err.param))

    async def _text_frames(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        reply = self.reply
        item_id = reply.message_id
        started = reply.response("in_progress", [], None)
        yield self.frame(ResponseEvent(type="response.created", response=started))
        yield self.frame(ResponseEvent(type="response.in_progress", response=started))
        yield self.frame(
            OutputItemEvent(
                type="response.output_item.added", item=reply.message("in_progress", [])
            )
        )
        yield self.frame(
            ContentPartEvent(
                type="response.content_part.added", item_id=item_id, part=OutputText(text="")
            )
        )
        text, finish_reason, cached = "", None, 0
        logprobs: list[ChatTokenLogprob] = []
        async for _, out in generation.outputs():
            cached = out.num_cached_tokens
            new_logprobs = reply.token_logprobs(out.new_logprobs)
            if out.new_text or new_logprobs:
                text += out.new_text
                logprobs += new_logprobs
                yield self.frame(
                    TextDeltaEvent(
                        type="response.output_text.delta",
                        item_id=item_id,
                        delta=out.new_text,
                        logprobs=new_logprobs,
                    )
                )
            if out.finished:
                finish_reason = out.finish_reason
        response = reply.finish(
            text,
            [],
            finish_reason,
            cached,
            generation.completion_tokens,
            with_message=True,
            logprobs=logprobs,
        )
        [message] = response.output
        [part] = message.content
        yield self.frame(
            TextDoneEvent(
                type="response.output_text.done", item_id=item_id, text=text, logprobs=logprobs
            )
        )
        yield self.frame(
            ContentPartEvent(type="response.content_part.done", item_id=item_id, part=part)
        )
        yield self.frame(OutputItemEvent(type="response.output_item.done", item=message))
        yield self.frame(ResponseEvent(type=f"response.{response.status}", response=response))

    async def _tool_frames(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        """A stream whose reply is parsed for calls: a message item opens with the first
        content, a function_call item with each call, whose argument fragments follow as
        ``response.function_call_arguments.delta`` events as the model writes them
        (``tools.streaming.ToolCallStream``); all close at the end. A call that never became
        whole closes with status ``incomplete`` and no ``function_call_arguments.done``, and the
        final response leaves it out, as a whole reply does."""
        reply = self.reply
        assert reply.plan.parser is not None
        started = reply.response("in_progress", [], None)
        yield self.frame(ResponseEvent(type="response.created", response=started))
        yield self.frame(ResponseEvent(type="response.in_progress", response=started))
        parsed = reply.plan.stream()
        message_index: int | None = None
        items: dict[int, tuple[int, FunctionCallItem]] = {}  # call index -> (output index, item)
        finish_reason, cached, next_index = None, 0, 0
        async for _, out in generation.outputs():
            cached = out.num_cached_tokens
            if out.finished:
                finish_reason = out.finish_reason
            content, deltas = parsed.feed(out.new_text, final=out.finished)
            ends_empty = out.finished and not (items or deltas or reply.plan.forced)
            if content or (ends_empty and message_index is None):
                if message_index is None:
                    message_index, next_index = next_index, next_index + 1
                    for data in self._open_message(message_index):
                        yield data
                if content:
                    yield self.frame(
                        TextDeltaEvent(
                            type="response.output_text.delta",
                            item_id=reply.message_id,
                            output_index=message_index,
                            delta=content,
                        )
                    )
            for d in deltas:
                if d.index not in items:  # the call's opening delta
                    item = FunctionCallItem(
                        id=new_item_id(),
                        call_id=str(d.id),
                        name=str(d.function.name),
                        arguments="",
                        status="in_progress",
                    )
                    items[d.index] = (next_index, item)
                    yield self.frame(
                        OutputItemEvent(
                            type="response.output_item.added", output_index=next_index, item=item
                        )
                    )
                    next_index += 1
                if d.function.arguments:
                    index, item = items[d.index]
                    item.arguments += str(d.function.arguments)
                    yield self.frame(
                        FunctionCallArgumentsDelta(
                            item_id=item.id, output_index=index, delta=str(d.function.arguments)
                        )
                    )
        whole = {call.index for call in parsed.calls if call.whole}
        for call_index, (_, item) in items.items():
            item.status = "completed" if call_index in whole else "incomplete"
        response = reply.finish(
            parsed.content,
            [item for i, (_, item) in items.items() if i in whole],
            finish_reason,
            cached,
            generation.completion_tokens,
            with_message=message_index is not None,
        )
        if message_index is not None:
            message = response.output[0]
            text = parsed.content
            yield self.frame(
                TextDoneEvent(
                    type="response.output_text.done",
                    item_id=reply.message_id,
                    output_index=message_index,
                    text=text,
                )
            )
            yield self.frame(
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=reply.message_id,
                    output_index=message_index,
                    part=OutputText(text=text),
                )
            )
            yield self.frame(
                OutputItemEvent(
                    type="response.output_item.done", output_index=message_index, item=message
                )
            )
        for index, item in items.values():
            if item.status == "completed":
                yield self.frame(
                    FunctionCallArgumentsDone(
                        item_id=item.id,
                        output_index=index,
                        name=item.name,
                        arguments=item.arguments,
                    )
                )
            yield self.frame(
                OutputItemEvent(type="response.output_item.done", output_index=index, item=item)
            )
        yield self.frame(ResponseEvent(type=f"response.{response.status}", response=response))

    def _open_message(self, output_index: int) -> list[bytes]:
        """The events that open the message item at ``output_index``: the item, its text part."""
        return [
            self.frame(
                OutputItemEvent(
                    type="response.output_item.added",
                    output_index=output_index,
                    item=self.reply.message("in_progress", []),
                )
            ),
            self.frame(
                ContentPartEvent(
                    type="response.content_part.added",
                    item_id=self.reply.message_id,
                    output_index=output_index,
                    part=OutputText(text=""),
                )
            ),
        ]
