"""``POST /v1/completions``: text completion of one or several prompts, n samples each.

Choice ``index`` = prompt_index * n + sample_index. ``echo`` puts the prompt text in front of
each choice's text (in a stream, as the first chunk of each choice, sent with its first
output); with ``logprobs`` the prompt's tokens come first in ``logprobs``, scored by the model
(the first one ``null``), which is how evaluation harnesses score a continuation. With
``max_tokens`` 0 nothing is generated: the request only scores (and echoes) its prompt. vLLM's
``prompt_logprobs`` adds its per-choice ``prompt_logprobs`` list (not in streams, as in vLLM).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from aiohttp import web
from msgspec import UNSET

from engine.outputs import RequestOutput
from server.completion_objects import Completion, CompletionChoice
from server.generation import Choice, Generation, Job, start_generation
from server.logprobs import (
    CompletionLogprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs,
)
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
        state.engine.vocab_size,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=body.engine_prompt_logprobs,
    )
    await compile_constraint(state.engine, params, body.constraint_field)
    n = body.n
    jobs = [Job(p * n, ids, params) for p, ids in enumerate(prompt_ids)]
    echoes = []
    if body.echo:
        tokenizer = state.engine.tokenizer
        for p, prompt in enumerate(prompts):
            echoes.append(prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids[p]))
    reply = CompletionReply(state, body, f"cmpl-{uuid.uuid4().hex}", prompt_ids, echoes)
    with start_generation(state, reply.id, jobs, "prompt") as generation:
        if body.stream:
            return await respond(request, reply.stream(generation))
        return await reply.complete(generation)


class CompletionReply(ChoiceReply):
    """Builds the Completion object, or the stream of Completion chunks.

    ``echoes[p]`` is prompt ``p``'s text (with ``echo``); choice ``index`` belongs to prompt
    ``index // n``.
    """

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        completion_id: str,
        prompt_ids: list[list[int]],
        echoes: list[str],
    ):
        prompt_tokens = sum(map(len, prompt_ids))
        super().__init__(state, completion_id, prompt_tokens, include_usage=body.include_usage)
        self.body = body
        self.prompt_ids = prompt_ids
        self.echoes = echoes
        self.tokenizer = state.engine.tokenizer

    def _echo_logprobs(self, index: int, scored: list) -> CompletionLogprobs:
        ids = self.prompt_ids[index // self.body.n]
        return echo_logprobs(self.tokenizer, ids, scored, self.body.logprobs)

    async def complete(self, generation: Generation) -> web.Response:
        choices = [self._choice(c) for c in await generation.collect()]
        return json_response(self.whole(Completion, choices, generation))

    def _choice(self, c: Choice) -> CompletionChoice:
        body = self.body
        text, logprobs = c.text, None
        if body.echo:
            text = self.echoes[c.index // body.n] + text
        if body.logprobs is not None:
            if body.echo:
                logprobs = self._echo_logprobs(c.index, c.prompt_logprobs)
                logprobs.extend(
                    completion_logprobs(self.tokenizer, c.logprobs, logprobs.end_offset)
                )
            else:
                logprobs = completion_logprobs(self.tokenizer, c.logprobs)
        scored = UNSET
        if body.prompt_logprobs is not None:
            scored = prompt_logprobs(self.tokenizer, c.prompt_logprobs, body.prompt_logprobs)
        return CompletionChoice(
            index=c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            prompt_logprobs=scored,
        )

    def _chunk(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None
    ) -> bytes:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return self.chunk(Completion, choice)

    def _echo_chunk(self, index: int, out: RequestOutput) -> tuple[bytes, int]:
        """The chunk that echoes choice ``index``'s prompt (with its first output, so a
        client's first chunk marks the first token), and where its logprob offsets end."""
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._echo_logprobs(index, out.prompt_logprobs)
        text = self.echoes[index // self.body.n]
        return self._chunk(index, text, logprobs, None), logprobs.end_offset if logprobs else 0

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        offsets: dict[int, int] = {}  # per choice started: where its next logprob offset is
        async for index, out in generation.outputs():
            if index not in offsets:
                offsets[index] = 0
                if self.body.echo:
                    chunk, offsets[index] = self._echo_chunk(index, out)
                    yield chunk
            logprobs = None
            if self.body.logprobs is not None and out.new_logprobs:
                logprobs = completion_logprobs(self.tokenizer, out.new_logprobs, offsets[index])
                offsets[index] = logprobs.end_offset
            if out.new_text or logprobs or out.finished:
                finish = out.finish_reason if out.finished else None
                yield self._chunk(index, out.new_text, logprobs, finish)
        if self.include_usage:
            yield self.usage_chunk(Completion, generation)
