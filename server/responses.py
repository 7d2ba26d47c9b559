"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

The prompt is ``instructions`` (as a system message), then the stored conversation of
``previous_response_id`` (its input and output messages, without its instructions), then
``input``, through the chat template. The output is one assistant message with one
``output_text`` part. A response that hit ``max_output_tokens`` has status ``incomplete``.

A stream sends typed events, each ``event: <type>`` + ``data: {..., "sequence_number": k}``
with k counting from 0: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
(repeated), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete``).
A failure mid-stream sends an ``error`` event and ends the stream. The response is stored
(``store``, default true) before its last event is sent.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from aiohttp import web

from server.errors import APIError
from server.generation import Generation, Job, start_generation
from server.prompts import chat_message, chat_prompt_ids
from server.protocol import ResponsesRequest, read_request
from server.response_objects import (
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    Response,
    ResponseDeleted,
    ResponseEvent,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
)
from server.response_store import StoredResponse
from server.sampling import output_limit
from server.sse import frame, respond
from server.state import OWNER, STATE, ServerState
from server.structured import compile_constraint
from server.wire import json_response


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, ResponsesRequest)
    owner = request.get(OWNER)
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = state.store.get(body.previous_response_id, owner)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation()
    if isinstance(body.input, str):
        new = [{"role": "user", "content": body.input}]
    else:
        for i, item in enumerate(body.input):
            if item.type != "message":
                raise APIError(
                    400, f"input item type {item.type!r} is not supported", param=f"input[{i}]"
                )
        new = [chat_message(m.role, m.content, f"input[{i}]") for i, m in enumerate(body.input)]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    prompt_ids = chat_prompt_ids(state.engine, system + history + new, "input")
    max_tokens = output_limit(state.context_limit, len(prompt_ids), body.max_output_tokens, "input")
    params = body.to_params(max_tokens=max_tokens)
    await compile_constraint(state.engine, params, "text.format")
    reply = ResponseReply(state, body, owner, history + new, len(prompt_ids))
    with start_generation(state, reply.id, [Job(0, prompt_ids, params)], "input") as generation:
        if body.stream:
            return await respond(
                request, reply.stream(generation), on_error=reply.error_event, done_marker=False
            )
        return json_response(await reply.complete(generation))


async def retrieve_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    entry = state.store.get(response_id, request.get(OWNER))
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.response)


async def delete_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    if not state.store.delete(response_id, request.get(OWNER)):
        raise _not_found(response_id)
    return json_response(ResponseDeleted(id=response_id))


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"no stored response with id {response_id!r}", param=param, code="response_not_found"
    )


class ResponseReply:
    """Builds the Response object and, for a stream, its events; stores the result."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        owner: str | None,
        messages: list[dict],
        prompt_tokens: int,
    ):
        self.state = state
        self.body = body
        self.owner = owner
        self.messages = messages  # the conversation so far, without the instructions
        self.prompt_tokens = prompt_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def _response(
        self, status: str, output: list[OutputMessage], usage: ResponseUsage | None
    ) -> Response:
        b = self.body
        return Response(
            id=self.id,
            created_at=self.created,
            completed_at=int(time.time()) if status == "completed" else None,
            status=status,
            incomplete_details=(
                IncompleteDetails("max_output_tokens") if status == "incomplete" else None
            ),
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            model=self.state.served_model_name,
            output=output,
            previous_response_id=b.previous_response_id,
            store=b.store,
            temperature=b.temperature,
            top_p=b.top_p,
            text=TextConfig(b.text.format) if b.text and b.text.format else TextConfig(),
            metadata=b.metadata or {},
            user=b.user,
            usage=usage,
        )

    def _message(self, status: str, parts: list[OutputText]) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=parts)

    def _finish(
        self, text: str, finish_reason: str | None, cached_tokens: int, output_tokens: int
    ) -> Response:
        """The final Response object; stores it when asked to."""
        status = "incomplete" if finish_reason == "length" else "completed"
        usage = ResponseUsage(
            input_tokens=self.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=self.prompt_tokens + output_tokens,
        )
        response = self._response(status, [self._message(status, [OutputText(text=text)])], usage)
        if self.body.store:
            conversation = [*self.messages, {"role": "assistant", "content": text}]
            entry = StoredResponse.encode(response, conversation, self.owner)
            self.state.store.put(self.id, entry)
        return response

    async def complete(self, generation: Generation) -> Response:
        [choice] = await generation.collect()
        return self._finish(
            choice.text,
            choice.finish_reason,
            choice.num_cached_tokens,
            generation.completion_tokens,
        )

    def _send(self, event: StreamEvent) -> bytes:
        """``event`` as a frame, numbered next."""
        event.sequence_number = self.sequence
        self.sequence += 1
        return frame(event, event=event.type)

    def error_event(self, err: APIError) -> bytes:
        return self._send(ErrorEvent(code=err.code, message=err.message, param=err.param))

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        item_id = self.message_id
        started = self._response("in_progress", [], None)
        yield self._send(ResponseEvent(type="response.created", response=started))
        yield self._send(ResponseEvent(type="response.in_progress", response=started))
        yield self._send(
            OutputItemEvent(
                type="response.output_item.added", item=self._message("in_progress", [])
            )
        )
        yield self._send(
            ContentPartEvent(
                type="response.content_part.added", item_id=item_id, part=OutputText(text="")
            )
        )
        text, finish_reason, cached = "", None, 0
        async for _, out in generation.outputs():
            cached = out.num_cached_tokens
            if out.new_text:
                text += out.new_text
                yield self._send(
                    TextDeltaEvent(
                        type="response.output_text.delta", item_id=item_id, delta=out.new_text
                    )
                )
            if out.finished:
                finish_reason = out.finish_reason
        response = self._finish(text, finish_reason, cached, generation.completion_tokens)
        [message] = response.output
        [part] = message.content
        yield self._send(
            TextDoneEvent(type="response.output_text.done", item_id=item_id, text=text)
        )
        yield self._send(
            ContentPartEvent(type="response.content_part.done", item_id=item_id, part=part)
        )
        yield self._send(OutputItemEvent(type="response.output_item.done", item=message))
        yield self._send(ResponseEvent(type=f"response.{response.status}", response=response))
