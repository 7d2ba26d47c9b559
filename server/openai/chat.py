"""``POST /v1/chat/completions``: the messages through the chat template, n samples.

A user message's ``image_url`` parts (for a model that takes images) are loaded and decoded
first (``paged_serve.server.media``), each replaced by the model's image marker in the text the
template renders; that text and the images then go through the model's processor.

A stream sends ``chat.completion.chunk`` objects: first a ``{"role": "assistant", "content":
""}`` delta per choice, then content deltas as tokens arrive, the choice's last chunk carrying
its ``finish_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null``
and one more chunk with ``"choices": []`` carries the usage. A choice's role delta goes out with
its first output, not before the prefill: benchmark clients that start the time-to-first-token
clock at the first chunk then measure the real TTFT.

vLLM's ``prompt_logprobs`` adds a ``prompt_logprobs`` list to the (non-streamed) object,
bounded by ``--max-prompt-logprob-entries`` and built in the tokenizer thread.

vLLM's chat template flags go to the template: ``add_generation_prompt`` false renders the
conversation without a new assistant turn, and ``continue_final_message`` leaves the last
message open, so the reply continues it ("prefill"); the reply's role is then the last
message's. ``echo`` puts the last message's text in front of the reply's content when the
reply continues that message's role (in a stream, as a content delta right after the role
delta); the echoed text has no logprobs, as in vLLM. ``return_token_ids``,
``return_tokens_as_token_ids``, ``include_stop_str_in_output`` and
``stream_options.continuous_usage_stats`` are vLLM's, shared with completions
(``paged_serve.server.openai.reply``, ``paged_serve.server.generation.logprobs``); the documented
fields this server does not implement are refused by ``paged_serve.server.protocol.unsupported``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator

from aiohttp import web
from msgspec import UNSET, UnsetType

from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.engine.outputs import TokenLogprob
from paged_serve.server.generation.logprobs import (
    chat_logprobs,
    check_prompt_logprobs_size,
    prompt_logprobs,
)
from paged_serve.server.generation.prompts import chat_prompt, message_text, off_loop
from paged_serve.server.generation.run import Generation, Job, start_generation
from paged_serve.server.generation.sampling import check_sequences, output_limit, sampling_params
from paged_serve.server.generation.structured import compile_constraint
from paged_serve.server.http.bodies import read_request
from paged_serve.server.http.sse import respond
from paged_serve.server.http.wire import encode, json_response
from paged_serve.server.media.images import conversation_images
from paged_serve.server.openai.reply import ChoiceReply
from paged_serve.server.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
)
from paged_serve.server.protocol.logprobs import ChatLogprobs
from paged_serve.server.state import OWNER, STATE, ServerState, tenant_cache_salt
from paged_serve.server.tools.planning import ToolPlan, plan_tools
from paged_serve.server.tools.reasoning import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    ReasoningStream,
)
from paged_serve.server.tools.streaming import call_delta_batches


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, ChatCompletionRequest)
    check_sequences(state.limits.max_sequences_per_request, 1, body.n)
    template = getattr(state.engine.tokenizer, "chat_template", None) or ""
    plan = plan_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, template, state.tool_call_parser
    )
    chat = await conversation_images(  # every image decoded before the engine sees any
        body.messages,
        [f"messages[{i}]" for i in range(len(body.messages))],
        marker=state.engine.image_marker,
        model=state.served_model_name,
        config=state.media,
    )
    prompt = await chat_prompt(
        state.engine,
        plan.conversation(chat.messages),
        "messages",
        images=chat.images,
        image_marker=chat.marker,
        tools=plan.template_tools,
        template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    multimodal = prompt if isinstance(prompt, MultimodalPrompt) else None
    prompt_ids = multimodal.token_ids if multimodal is not None else prompt
    reasoning = None
    if state.reasoning_parser is not None:
        tail = state.engine.tokenizer.decode(prompt_ids[-8:])
        reasoning = REASONING_PARSERS[state.reasoning_parser](tail)
    max_tokens = output_limit(
        state.context_limit,
        len(prompt_ids),
        body.output_limit,
        "messages",
        state.sampling_defaults.max_tokens,
    )
    if body.prompt_logprobs is not None:
        limit = state.limits.max_prompt_logprob_entries
        check_prompt_logprobs_size(limit, len(prompt_ids), body.prompt_logprobs)
    params = sampling_params(
        body,
        state.engine.vocab_size,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
    )
    params = plan.constrain(params, body.constraint_field)
    if reasoning is not None and params.structured_output is not None:
        after = reasoning.grammar_after(state.engine.tokenizer)
        if after is not None:  # the grammar holds once the reasoning ends
            params = dataclasses.replace(params, structured_output_after=after)
    await compile_constraint(state.engine, params, plan.constraint_param(body.constraint_field))
    jobs = [Job(0, prompt_ids, params, images=multimodal)]
    reply = ChatReply(state, body, plan, reasoning, f"chatcmpl-{uuid.uuid4().hex}", prompt_ids)
    salt = tenant_cache_salt(request.get(OWNER), body.cache_salt)
    lora = state.lora_for(body.model)
    with start_generation(
        state, reply.id, jobs, "messages", cache_salt=salt, lora=lora
    ) as generation:
        if body.stream:
            return await respond(request, reply.stream(generation))
        return await reply.complete(generation)


class ChatReply(ChoiceReply):
    """Builds the ChatCompletion object, or the stream of ChatCompletionChunks."""

    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        plan: ToolPlan,
        reasoning: Qwen3ReasoningParser | None,
        reply_id: str,
        prompt_ids: list[int],
    ):
        super().__init__(state, reply_id, len(prompt_ids), body)
        self.body = body
        self.plan = plan
        self.reasoning = reasoning
        self.prompt_ids = prompt_ids
        self.role = body.reply_role
        self.echo = echo_text(body)

    def message(self, text: str) -> AssistantMessage:
        reasoning: str | None | UnsetType = UNSET
        if self.reasoning is not None:
            split = self.reasoning.split(text, final=True)
            text, reasoning = split.content, split.reasoning or None
        content: str | None = text
        calls: list | UnsetType = UNSET
        if self.plan.parser is not None:
            content, found = self.plan.reply(text)
            # a forced reply always has its list, empty when max_tokens cut its only call
            calls = found if self.plan.forced else (found or UNSET)
        if self.echo:
            content = self.echo + (content or "")
        return AssistantMessage(
            role=self.role, content=content, tool_calls=calls, reasoning_content=reasoning
        )

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        tokenizer = self.state.engine.tokenizer
        return chat_logprobs(tokenizer, logprobs, as_ids=self.body.return_tokens_as_token_ids)

    async def complete(self, generation: Generation) -> web.Response:
        tokenizer = self.state.engine.tokenizer
        choices = []
        collected = await self.collect(generation)
        for c in collected:
            message = self.message(c.text)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.logprobs) if self.body.logprobs else None,
                    finish_reason=ToolPlan.finish_reason(c.finish_reason, bool(message.tool_calls)),
                    token_ids=c.token_ids if self.return_token_ids else UNSET,
                )
            )
        reply = self.whole(ChatCompletion, choices, generation)
        if self.return_token_ids:
            reply.prompt_token_ids = self.prompt_ids
        top = self.body.prompt_logprobs
        if top is None:
            return json_response(reply)
        scored = collected[0].prompt_logprobs  # the same prompt for every choice

        def build() -> bytes:
            reply.prompt_logprobs = prompt_logprobs(tokenizer, scored, top)
            return encode(reply)

        return json_response(await off_loop(build))  # up to megabytes: off the event loop

    def _chunk(
        self,
        generation: Generation,
        index: int,
        delta: ChatDelta,
        logprobs: ChatLogprobs | None = None,
        finish: str | None = None,
    ) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self.chunk(ChatCompletionChunk, choice, generation)

    def _first_chunks(self, generation: Generation, index: int) -> list[bytes]:
        """Choice ``index``'s role delta (with the prompt's ids, when asked) and its echo."""
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(role=self.role, content=""),
            logprobs=None,
            finish_reason=None,
        )
        fields = {"prompt_token_ids": self.prompt_ids} if self.return_token_ids else {}
        chunks = [self.chunk(ChatCompletionChunk, choice, generation, **fields)]
        if self.echo:
            chunks.append(self._chunk(generation, index, ChatDelta(content=self.echo)))
        return chunks

    async def stream(self, generation: Generation) -> AsyncGenerator[bytes, None]:
        parsed = self.plan.parser is not None
        calls = [self.plan.stream() for _ in range(self.body.n)] if parsed else []
        thinking = (
            [ReasoningStream(self.reasoning) for _ in range(self.body.n)] if self.reasoning else []
        )
        started: set[int] = set()  # a choice's role delta goes out with its first token
        async for index, out in self.outputs(generation):
            if index not in started:
                started.add(index)
                for chunk in self._first_chunks(generation, index):
                    yield chunk
            self.hold(index, out.new_token_ids)
            logprobs = None
            if self.body.logprobs and out.new_logprobs:
                logprobs = self._logprobs(out.new_logprobs)
            if not (out.new_text or logprobs or out.finished):
                continue
            finish = out.finish_reason if out.finished else None
            text, reasoning = out.new_text, ""
            if self.reasoning is not None:
                split = thinking[index].feed(text, final=out.finished)
                text, reasoning = split.content, split.reasoning
            more: list[ChatDelta] = []  # chunks after this one: a call's next deltas
            if calls:
                content, deltas = calls[index].feed(text, final=out.finished)
                first, *rest = call_delta_batches(deltas) or [[]]
                delta = ChatDelta(content=content or UNSET, tool_calls=first or UNSET)
                more = [ChatDelta(tool_calls=batch) for batch in rest]
                finish = ToolPlan.finish_reason(finish, calls[index].has_calls)
            else:
                delta = ChatDelta(content=text) if text else ChatDelta()
            if reasoning:
                delta.reasoning_content = reasoning
            if delta == ChatDelta() and not (logprobs or finish):
                continue
            if more:  # the token's logprobs go with its first chunk, the finish with its last
                yield self._chunk(generation, index, delta, logprobs)
                for extra in more[:-1]:
                    yield self._chunk(generation, index, extra)
                delta, logprobs = more[-1], None
            yield self._chunk(generation, index, delta, logprobs, finish)
        if self.include_usage:
            yield self.usage_chunk(ChatCompletionChunk, generation)


def echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's text when the reply continues that message's
    role (so with ``add_generation_prompt``, only an assistant message's), else nothing."""
    last = len(body.messages) - 1
    message = body.messages[last]
    if not body.echo or message.role != body.reply_role:
        return ""
    return message_text(message.content, f"messages[{last}].content")
