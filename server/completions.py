"""``POST /v1/completions``: text completion of one or several prompts, n samples each.

Choice ``index`` = prompt_index * n + sample_index. ``echo`` puts the prompt text in front of
each choice's text (in a stream, as the first chunk of each choice).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from aiohttp import web

from server.completion_objects import Completion, CompletionChoice
from server.generation import Generation, Job, start_generation
from server.logprobs import CompletionLogprobs, completion_logprobs
from server.prompts import tokenize_prompt
from server.protocol import CompletionRequest, read_request
from server.reply import ChoiceReply
from server.sampling import check_sequences, output_limit
from server.sse import respond
from server.state import STATE, ServerState
from server.structured import compile_constraint
from server.wire import json_response


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, CompletionRequest)
    prompts = body.prompts()
    check_sequences(state.limits.max_sequences_per_request, len(prompts), body.n)
    prompt_ids = [tokenize_prompt(state.engine, p, "prompt") for p in prompts]
    for ids in prompt_ids:
        output_limit(state.context_limit, len(ids), body.max_tokens, "prompt")
    params = body.to_params(
        state.engine.vocab_size, max_tokens=body.max_tokens, logprobs=body.logprobs
    )
    await compile_constraint(state.engine, params, body.constraint_field)
    n = body.n
    jobs = [Job(p * n, ids, params) for p, ids in enumerate(prompt_ids)]
    echoes = {}
    if body.echo:
        tokenizer = state.engine.tokenizer
        for p, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids[p])
            echoes.update({p * n + i: text for i in range(n)})
    reply = CompletionReply(
        state, body, f"cmpl-{uuid.uuid4().hex}", sum(map(len, prompt_ids)), echoes
    )
    with start_generation(state, reply.id, jobs, "prompt") as generation:
        if body.stream:
            return await respond(request, reply.stream(generation))
        return await reply.complete(generation)


class CompletionReply(ChoiceReply):
    """Builds the Completion object, or the stream of Completion chunks."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        completion_id: str,
        prompt_tokens: int,
        echoes: dict[int, str],
    ):
        super().__init__(state, completion_id, prompt_tokens, include_usage=body.include_usage)
        self.body = body
        self.echoes = echoes

    async def complete(self, generation: Generation) -> web.Response:
        tokenizer = self.state.engine.tokenizer
        choices = []
        for c in await generation.collect():
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, c.logprobs)
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=self.echoes.get(c.index, "") + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                )
            )
        return json_response(self.whole(Completion, choices, generation))

    def _chunk(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None
    ) -> bytes:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return self.chunk(Completion, choice)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        tokenizer = self.state.engine.tokenizer
        for index, text in sorted(self.echoes.items()):
            yield self._chunk(index, text, None, None)
        offsets: dict[int, int] = {}
        async for index, out in generation.outputs():
            logprobs = None
            if self.body.logprobs is not None and out.new_logprobs:
                logprobs = completion_logprobs(tokenizer, out.new_logprobs, offsets.get(index, 0))
                offsets[index] = logprobs.end_offset
            if out.new_text or logprobs or out.finished:
                finish = out.finish_reason if out.finished else None
                yield self._chunk(index, out.new_text, logprobs, finish)
        if self.include_usage:
            yield self.usage_chunk(Completion, generation)
