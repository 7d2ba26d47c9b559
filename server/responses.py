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

import msgspec
from aiohttp import web

from server.errors import APIError
from server.generation import Generation, Job, start_generation
from server.prompts import chat_message, chat_prompt_ids
from server.protocol import ResponsesRequest, read_request
from server.response_store import StoredResponse
from server.sampling import output_limit
from server.sse import frame, respond
from server.state import OWNER, STATE, ServerState


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
    reply = _Reply(state, body, owner, history + new, len(prompt_ids))
    with start_generation(state, reply.id, [Job(0, prompt_ids, params)], "input") as generation:
        if body.stream:
            return await respond(
                request, reply.stream(generation), on_error=reply.error_event, done_marker=False
            )
        return _json(await reply.complete(generation))


async def retrieve_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    entry = state.store.get(response_id, request.get(OWNER))
    if entry is None:
        raise _not_found(response_id)
    return web.Response(body=entry.response, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    if not state.store.delete(response_id, request.get(OWNER)):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response", "deleted": True})


def _json(data: dict) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"no stored response with id {response_id!r}", param=param, code="response_not_found"
    )


class _Reply:
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

    def _response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.state.served_model_name,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": usage,
        }

    def _message(self, status: str, parts: list[dict]) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": parts,
        }

    @staticmethod
    def _text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _finish(
        self, text: str, finish_reason: str | None, cached_tokens: int, output_tokens: int
    ) -> dict:
        """The final Response object; stores it when asked to."""
        status = "incomplete" if finish_reason == "length" else "completed"
        usage = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output_tokens,
        }
        message = self._message(status, [self._text_part(text)])
        response = self._response(status, [message], usage)
        if self.body.store:
            conversation = [*self.messages, {"role": "assistant", "content": text}]
            entry = StoredResponse.encode(response, conversation, self.owner)
            self.state.store.put(self.id, entry)
        return response

    async def complete(self, generation: Generation) -> dict:
        [choice] = await generation.collect()
        return self._finish(
            choice.text,
            choice.finish_reason,
            choice.num_cached_tokens,
            generation.completion_tokens,
        )

    def _event(self, kind: str, **fields: object) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return frame(data, event=kind)

    def error_event(self, err: APIError) -> bytes:
        return self._event("error", code=err.code, message=err.message, param=err.param)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        ids = {"item_id": self.message_id, "output_index": 0}
        yield self._event("response.created", response=self._response("in_progress", [], None))
        yield self._event("response.in_progress", response=self._response("in_progress", [], None))
        yield self._event(
            "response.output_item.added", output_index=0, item=self._message("in_progress", [])
        )
        part = self._text_part("")
        yield self._event("response.content_part.added", **ids, content_index=0, part=part)
        text, finish_reason, cached = "", None, 0
        async for _, out in generation.outputs():
            cached = out.num_cached_tokens
            if out.new_text:
                text += out.new_text
                yield self._event(
                    "response.output_text.delta",
                    **ids,
                    content_index=0,
                    delta=out.new_text,
                    logprobs=[],
                )
            if out.finished:
                finish_reason = out.finish_reason
        response = self._finish(text, finish_reason, cached, generation.completion_tokens)
        [message] = response["output"]
        [part] = message["content"]
        yield self._event(
            "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
        )
        yield self._event("response.content_part.done", **ids, content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=0, item=message)
        yield self._event(f"response.{response['status']}", response=response)
