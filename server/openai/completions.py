"""``POST /v1/completions``: text completion of one or several prompts, n samples each.

Choice ``index`` = prompt_index * n + sample_index. ``echo`` puts the prompt text in front of
each choice's text (in a stream, as the first chunk of each choice, sent with its first
output); with ``logprobs`` the prompt's tokens come first in ``logprobs``, scored by the model
(the first one ``null``), which is how evaluation harnesses score a continuation. With
``max_tokens`` 0 nothing is generated: the request only scores (and echoes) its prompt. vLLM's
``prompt_logprobs`` adds its per-choice ``prompt_logprobs`` list (not in streams, as in vLLM),
bounded by ``--max-prompt-logprob-entries`` over all choices; such a reply is built in the
tokenizer thread.

vLLM's ``return_token_ids`` adds each choice's ``prompt_token_ids`` (in a stream, to its first
chunk) and ``token_ids`` (the generated ids only, even with ``echo``; in a stream, each chunk's
new ones). ``return_tokens_as_token_ids``, ``include_stop_str_in_output`` and
``stream_options.continuous_usage_stats`` are shared with chat (``paged_serve.server.openai.reply``,
``paged_serve.server.generation.logprobs``); the documented fields this server does not
implement are refused by ``paged_serve.server.protocol.unsupported``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from aiohttp import web
from msgspec import UNSET, UnsetType

from paged_serve.engine.outputs import TokenLogprob
from paged_serve.server.generation.logprobs import (
    ChoiceLogprobs,
    check_prompt_logprobs_size,
    prompt_logprobs,
)
from paged_serve.server.generation.prompts import off_loop, tokenize_prompt
from paged_serve.server.generation.run import Choice, Generation, Job, start_generation
from paged_serve.server.generation.sampling import check_sequences, output_limit, sampling_params
from paged_serve.server.generation.structured import compile_constraint
from paged_serve.server.http.bodies import read_request
from paged_serve.server.http.sse import respond
from paged_serve.server.http.wire import encode, json_response
from paged_serve.server.openai.reply import ChoiceReply
from paged_serve.server.protocol.completions import Completion, CompletionChoice, CompletionRequest
from paged_serve.server.protocol.logprobs import CompletionLogprobs
from paged_serve.server.state import OWNER, STATE, ServerState, tenant_cache_salt


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, CompletionRequest)
    prompts = body.prompts()
    check_sequences(state.limits.max_sequences_per_request, len(prompts), body.n)
    prompt_ids = [await tokenize_prompt(state.engine, p, "prompt") for p in prompts]
    default = state.sampling_defaults.max_tokens
    max_tokens = min(
        output_limit(state.context_limit, len(ids), body.max_tokens, "prompt", default)
        for ids in prompt_ids
    )
    if body.prompt_logprobs is not None:
        limit = state.limits.max_prompt_logprob_entries
        check_prompt_logprobs_size(limit, sum(map(len, prompt_ids)), body.prompt_logprobs, body.n)
    params = sampling_params(
        body,
        state.engine.vocab_size,
        max_tokens=max_tokens,
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
    salt = tenant_cache_salt(request.get(OWNER), body.cache_salt)
    lora = state.lora_for(body.model)
    with start_generation(
        state, reply.id, jobs, "prompt", cache_salt=salt, lora=lora
    ) as generation:
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
        super().__init__(state, completion_id, sum(map(len, prompt_ids)), body)
        self.body = body
        self.prompt_ids = prompt_ids
        self.echoes = echoes
        self.tokenizer = state.engine.tokenizer

    def _new_logprobs(self) -> ChoiceLogprobs:
        return ChoiceLogprobs(self.tokenizer, as_ids=self.body.return_tokens_as_token_ids)

    def _echo_logprobs(
        self, logs: ChoiceLogprobs, index: int, scored: list[TokenLogprob | None]
    ) -> CompletionLogprobs:
        return logs.echo(self.prompt_ids[index // self.body.n], scored, self.body.logprobs)

    async def complete(self, generation: Generation) -> web.Response:
        collected = await self.collect(generation)

        def build() -> bytes:
            choices = [self._choice(c) for c in collected]
            return encode(self.whole(Completion, choices, generation))

        if self.body.prompt_logprobs is not None:  # up to megabytes: off the event loop
            return json_response(await off_loop(build))
        return json_response(build())

    def _choice(self, c: Choice) -> CompletionChoice:
        body = self.body
        text, logprobs = c.text, None
        if body.echo:
            text = self.echoes[c.index // body.n] + text
        if body.logprobs is not None:
            logs = self._new_logprobs()
            if body.echo:
                logprobs = self._echo_logprobs(logs, c.index, c.prompt_logprobs)
                logprobs.extend(logs.generated(c.logprobs))
            else:
                logprobs = logs.generated(c.logprobs)
        scored = UNSET
        if body.prompt_logprobs is not None:
            scored = prompt_logprobs(self.tokenizer, c.prompt_logprobs, body.prompt_logprobs)
        return CompletionChoice(
            index=c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            prompt_logprobs=scored,
            prompt_token_ids=self._prompt_ids(c.index),
            token_ids=c.token_ids if self.return_token_ids else UNSET,
        )

    def _prompt_ids(self, index: int) -> list[int] | UnsetType:
        """Choice ``index``'s prompt ids, when asked for."""
        return self.prompt_ids[index // self.body.n] if self.return_token_ids else UNSET

    def _chunk(
        self,
        generation: Generation,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        finish: str | None,
        *,
        first: bool,
    ) -> bytes:
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            prompt_token_ids=self._prompt_ids(index) if first else UNSET,
        )
        return self.chunk(Completion, choice, generation)

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        # per choice started: its logprobs builder (which knows where its next text offset is)
        logs: dict[int, ChoiceLogprobs] = {}
        sent: set[int] = set()  # choices whose first chunk (with the prompt's ids) went out
        async for index, out in self.outputs(generation):
            if index not in logs:
                logs[index] = self._new_logprobs()
                if self.body.echo:
                    # the echo goes with the first output, so a client's first chunk marks
                    # the first token
                    scored = None
                    if self.body.logprobs is not None:
                        scored = self._echo_logprobs(logs[index], index, out.prompt_logprobs)
                    text = self.echoes[index // self.body.n]
                    yield self._chunk(generation, index, text, scored, None, first=True)
                    sent.add(index)
            self.hold(index, out.new_token_ids)
            logprobs = None
            if self.body.logprobs is not None and out.new_logprobs:
                logprobs = logs[index].generated(out.new_logprobs)
            if out.new_text or logprobs or out.finished:
                finish = out.finish_reason if out.finished else None
                first = index not in sent
                sent.add(index)
                yield self._chunk(generation, index, out.new_text, logprobs, finish, first=first)
        if self.include_usage:
            yield self.usage_chunk(Completion, generation)
