"""``POST /v1/chat/completions``: the messages through the chat template, n samples.

A stream sends ``chat.completion.chunk`` objects: first a ``{"role": "assistant", "content":
""}`` delta per choice, then content deltas as tokens arrive, the choice's last chunk carrying
its ``finish_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null``
and one more chunk with ``"choices": []`` carries the usage.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

import msgspec
from aiohttp import web

from server.generation import Generation, Job, start_generation
from server.logprobs import chat_logprobs
from server.prompts import chat_message, chat_prompt_ids
from server.protocol import ChatCompletionRequest, read_request
from server.reply import ReplyEnvelope
from server.sampling import check_sequences, output_limit
from server.sse import frame, respond
from server.state import STATE, ServerState


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
    )
    jobs = [Job(0, prompt_ids, params)]
    reply = _Reply(state, body, f"chatcmpl-{uuid.uuid4().hex}", len(prompt_ids))
    with start_generation(state, reply.id, jobs, "messages") as generation:
        if body.stream:
            return await respond(request, reply.stream(generation))
        return await reply.complete(generation)


class _Reply(ReplyEnvelope):
    """Builds the ChatCompletion object, or the stream of ChatCompletionChunks."""

    def __init__(
        self, state: ServerState, body: ChatCompletionRequest, reply_id: str, prompt_tokens: int
    ):
        super().__init__(state, reply_id, prompt_tokens)
        self.body = body

    async def complete(self, generation: Generation) -> web.Response:
        tokenizer = self.state.engine.tokenizer
        choices = []
        for c in await generation.collect():
            logprobs = None
            if self.body.logprobs:
                logprobs = {"content": chat_logprobs(tokenizer, c.logprobs), "refusal": None}
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        out = self.envelope("chat.completion", choices)
        out["usage"] = generation.usage(self.prompt_tokens)
        return web.Response(body=msgspec.json.encode(out), content_type="application/json")

    def _chunk(self, choice: dict) -> bytes:
        out = self.envelope("chat.completion.chunk", [choice])
        if self.body.include_usage:
            out["usage"] = None
        return frame(out)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        tokenizer = self.state.engine.tokenizer
        for index in range(self.body.n):
            delta = {"role": "assistant", "content": ""}
            yield self._chunk(
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            )
        async for index, out in generation.outputs():
            logprobs = None
            if self.body.logprobs and out.new_logprobs:
                logprobs = {"content": chat_logprobs(tokenizer, out.new_logprobs), "refusal": None}
            if not (out.new_text or logprobs or out.finished):
                continue
            yield self._chunk(
                {
                    "index": index,
                    "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
            )
        if self.body.include_usage:
            out = self.envelope("chat.completion.chunk", [])
            out["usage"] = generation.usage(self.prompt_tokens)
            yield frame(out)
