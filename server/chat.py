"""``POST /v1/chat/completions``: the messages through the chat template, n samples.

A stream sends ``chat.completion.chunk`` objects: first a ``{"role": "assistant", "content":
""}`` delta per choice, then content deltas as tokens arrive, the choice's last chunk carrying
its ``finish_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null``
and one more chunk with ``"choices": []`` carries the usage. A choice's role delta goes out with
its first output, not before the prefill: benchmark clients that start the time-to-first-token
clock at the first chunk then measure the real TTFT.

vLLM's ``prompt_logprobs`` adds a ``prompt_logprobs`` list to the (non-streamed) object.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from aiohttp import web

from server.completion_objects import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
)
from server.generation import Generation, Job, start_generation
from server.logprobs import ChatLogprobs, chat_logprobs, prompt_logprobs
from server.prompts import chat_message, chat_prompt_ids
from server.protocol import ChatCompletionRequest, read_request
from server.reply import ChoiceReply
from server.sampling import check_sequences, output_limit
from server.sse import respond
from server.state import STATE, ServerState
from server.wire import json_response


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, ChatCompletionRequest)
    check_sequences(state.limits.max_sequences_per_request, 1, body.n)
    messages = [
        chat_message(m.role, m.content, f"messages[{i}]") for i, m in enumerate(body.messages)
    ]
    prompt_ids = chat_prompt_ids(state.engine, messages, "messages")
    max_tokens = output_limit(state.context_limit, len(prompt_ids), body.output_limit, "messages")
    params = body.to_params(
        state.engine.vocab_size,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
    )
    jobs = [Job(0, prompt_ids, params)]
    reply = ChatReply(state, body, f"chatcmpl-{uuid.uuid4().hex}", len(prompt_ids))
    with start_generation(state, reply.id, jobs, "messages") as generation:
        if body.stream:
            return await respond(request, reply.stream(generation))
        return await reply.complete(generation)


class ChatReply(ChoiceReply):
    """Builds the ChatCompletion object, or the stream of ChatCompletionChunks."""

    def __init__(
        self, state: ServerState, body: ChatCompletionRequest, reply_id: str, prompt_tokens: int
    ):
        super().__init__(state, reply_id, prompt_tokens, include_usage=body.include_usage)
        self.body = body

    async def complete(self, generation: Generation) -> web.Response:
        tokenizer = self.state.engine.tokenizer
        choices = []
        collected = await generation.collect()
        for c in collected:
            logprobs = chat_logprobs(tokenizer, c.logprobs) if self.body.logprobs else None
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                )
            )
        reply = self.whole(ChatCompletion, choices, generation)
        if self.body.prompt_logprobs is not None:  # the same prompt for every choice
            scored = collected[0].prompt_logprobs
            reply.prompt_logprobs = prompt_logprobs(tokenizer, scored, self.body.prompt_logprobs)
        return json_response(reply)

    def _chunk(
        self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None, finish: str | None
    ) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self.chunk(ChatCompletionChunk, choice)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        tokenizer = self.state.engine.tokenizer
        started: set[int] = set()
        async for index, out in generation.outputs():
            if index not in started:
                started.add(index)
                yield self._chunk(index, ChatDelta(role="assistant", content=""), None, None)
            logprobs = None
            if self.body.logprobs and out.new_logprobs:
                logprobs = chat_logprobs(tokenizer, out.new_logprobs)
            if not (out.new_text or logprobs or out.finished):
                continue
            delta = ChatDelta(content=out.new_text) if out.new_text else ChatDelta()
            yield self._chunk(index, delta, logprobs, out.finish_reason if out.finished else None)
        if self.include_usage:
            yield self.usage_chunk(ChatCompletionChunk, generation)
