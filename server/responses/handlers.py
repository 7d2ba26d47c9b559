"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

The prompt is ``instructions`` (as a system message), then the stored conversation of
``previous_response_id`` (its input and output messages, without its instructions), then ``input``,
through the chat template; their ``input_image`` parts, for a model that takes images, are loaded
and decoded first (``paged_serve.server.media``). The output is one assistant message with one
``output_text`` part; with function tools (``paged_serve.server.responses.tools``), text before the
calls is that message and each call a ``function_call`` item. A response that hit
``max_output_tokens`` has status ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``); a call it cut off is no item (under ``auto`` its text is the message's, a
forced reply's output is empty).

``stream: true`` sends the response as typed, numbered events
(``paged_serve.server.responses.stream``). The response is stored (``store``, default true) for
``GET`` and ``previous_response_id``.

``include: ["message.output_text.logprobs"]`` (with ``top_logprobs`` alternatives, 0-20) gives
the ``output_text`` part, each ``response.output_text.delta`` (its own tokens) and
``response.output_text.done`` a ``logprobs`` list of chat-shaped token entries
(``paged_serve.server.generation.logprobs``); a delta may carry tokens whose text is still held back
(part of a UTF-8 character), so the deltas' lists concatenate to the part's. Not with
function tools that may be called (which tokens make the text is then the parser's business):
a 400 naming ``include``.

``background: true`` runs the generation as a task of the server (``background``):
``GET`` polls it, ``?stream=true&starting_after=N`` resumes a streamed one after event N, and
``POST /v1/responses/{id}/cancel`` cancels it. ``DELETE`` of a running one cancels it first.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.server.generation.prompts import chat_prompt
from paged_serve.server.generation.run import Job, start_generation
from paged_serve.server.generation.sampling import output_limit, responses_params
from paged_serve.server.generation.structured import compile_constraint
from paged_serve.server.http.bodies import read_request
from paged_serve.server.http.sse import respond
from paged_serve.server.http.wire import json_response
from paged_serve.server.media.images import conversation_images
from paged_serve.server.protocol.chat import ChatMessage
from paged_serve.server.protocol.errors import APIError, bad_request
from paged_serve.server.protocol.responses import ResponseDeleted, ResponsesRequest
from paged_serve.server.responses.background import BACKGROUND
from paged_serve.server.responses.reply import ResponseReply
from paged_serve.server.responses.stream import ResponseStream
from paged_serve.server.responses.tools import chat_tool_choice, chat_tools, input_messages
from paged_serve.server.state import OWNER, STATE, tenant_cache_salt
from paged_serve.server.tools.planning import ToolPlan, plan_tools


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_request(request, ResponsesRequest)
    owner = request.get(OWNER)
    runs = request.app[BACKGROUND]
    if body.background:
        runs.check_room(owner)  # early, before tokenizing; again where the run starts
    history: list[dict] = []
    if body.previous_response_id is not None:
        running = runs.get(body.previous_response_id, owner)
        if running is not None:
            raise bad_request(
                f"response {body.previous_response_id!r} is still {running.status}; "
                "continue it once it has finished",
                "previous_response_id",
            )
        previous = state.store.get(body.previous_response_id, owner)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation()
    if isinstance(body.input, str):
        new, new_params = [{"role": "user", "content": body.input}], ["input"]
    else:
        new, new_params = input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    template = getattr(state.engine.tokenizer, "chat_template", None) or ""
    plan = plan_tools(
        chat_tools(body.tools),
        chat_tool_choice(body.tool_choice),
        body.parallel_tool_calls,
        template,
        state.tool_call_parser,
    )
    if body.output_logprobs is not None and plan.parser is not None:
        raise bad_request(
            "message.output_text.logprobs is not available with function tools the model may "
            "call (tool_choice other than none)",
            "include",
        )
    names = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + new_params
    chat = await conversation_images(  # every image decoded before the engine sees any
        _chat_messages(system + history + new),
        names,
        marker=state.engine.image_marker,
        model=state.served_model_name,
        config=state.media,
    )
    prompt = await chat_prompt(
        state.engine,
        _template_messages(chat.messages, plan, names),
        "input",
        images=chat.images,
        image_marker=chat.marker,
        tools=plan.template_tools,
    )
    multimodal = prompt if isinstance(prompt, MultimodalPrompt) else None
    prompt_ids = multimodal.token_ids if multimodal is not None else prompt
    max_tokens = output_limit(
        state.context_limit,
        len(prompt_ids),
        body.max_output_tokens,
        "input",
        state.sampling_defaults.max_tokens,
    )
    params = responses_params(body, max_tokens=max_tokens, defaults=state.sampling_defaults)
    params = plan.constrain(params, "text.format")
    await compile_constraint(state.engine, params, plan.constraint_param("text.format"))
    reply = ResponseReply(state, body, owner, history + new, len(prompt_ids), plan)
    salt = tenant_cache_salt(owner, body.cache_salt)
    if body.background:  # other requests may have started runs while this one awaited
        runs.check_room(owner)
    job = Job(0, prompt_ids, params, images=multimodal)
    lora = state.lora_for(body.model)
    generation = start_generation(state, reply.id, [job], "input", cache_salt=salt, lora=lora)
    if body.background:
        run = runs.start(reply, generation, stream=body.stream)  # the run owns generation now
        if body.stream:
            return await respond(
                request, run.log.follow(-1), on_error=run.log.error_frame, done_marker=False
            )
        return json_response(run.snapshot())
    with generation:
        if body.stream:
            events = ResponseStream(reply)
            return await respond(
                request, events.frames(generation), on_error=events.error_frame, done_marker=False
            )
        return json_response(await reply.complete(generation))


def _chat_messages(messages: list[dict]) -> list[ChatMessage]:
    """Chat messages (``ChatMessage`` builtins) as ``ChatMessage``s."""
    try:
        return msgspec.convert(messages, list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid input: {exc}", "input") from None


def _template_messages(chat: list[ChatMessage], plan: ToolPlan, names: list[str]) -> list[dict]:
    """Chat messages as template dicts; errors name the Responses field (``call_id`` where
    chat says ``tool_call_id``)."""
    try:
        return plan.conversation(chat, names)
    except APIError as err:
        if err.param and err.param.startswith("input[") and err.param.endswith(".tool_call_id"):
            err.param = err.param.removesuffix(".tool_call_id") + ".call_id"
        raise


async def retrieve_response(request: web.Request) -> web.StreamResponse:
    """The response: a running background one as it stands (``output`` empty until it ends),
    else the stored one. ``?stream=true`` streams a running background response's events
    (created with ``stream: true``) from the start, or after ``starting_after``."""
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    owner = request.get(OWNER)
    stream = _query_flag(request, "stream")
    after = _query_count(request, "starting_after")
    if after is not None and not stream:
        raise bad_request("starting_after is only allowed with stream=true", "starting_after")
    run = request.app[BACKGROUND].get(response_id, owner)
    if stream:
        if run is None:
            if state.store.get(response_id, owner) is None:
                raise _not_found(response_id)
            raise bad_request(
                f"response {response_id!r} is not a running background response: events are "
                "kept only while one runs; GET it without stream",
                "stream",
            )
        if run.log is None:
            raise bad_request(
                f"response {response_id!r} was not created with stream: true, so its events "
                "are not kept; GET it without stream",
                "stream",
            )
        start = -1 if after is None else after
        run.log.check_resumable(start)
        return await respond(
            request, run.log.follow(start), on_error=run.log.error_frame, done_marker=False
        )
    if run is not None:
        return json_response(run.snapshot())
    entry = state.store.get(response_id, owner)
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.response)


async def cancel_response(request: web.Request) -> web.Response:
    """``POST /v1/responses/{id}/cancel``, for responses created with ``background: true``.

    A running one is cancelled (its engine requests aborted, their KV blocks freed in the
    engine's next step) and returned with status ``cancelled``. As OpenAI documents, cancelling
    again is idempotent: a ``cancelled`` response is returned unchanged. One that ended
    otherwise (``completed``, ``incomplete``, ``failed``) cannot be cancelled: 400, as OpenAI
    answers ("Cannot cancel a completed response."). A response created without
    ``background`` is a 400 too; an unknown id (or another key's) a 404.
    """
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    owner = request.get(OWNER)
    run = request.app[BACKGROUND].get(response_id, owner)
    if run is not None:
        response = await run.cancel()
        if response.status != "cancelled":  # it finished before the cancel reached it
            raise _cannot_cancel(response.status)
        return json_response(response)
    entry = state.store.get(response_id, owner)
    if entry is None:
        raise _not_found(response_id)
    if not entry.background:
        raise bad_request("only responses created with background set to true can be cancelled")
    if entry.status != "cancelled":
        raise _cannot_cancel(entry.status)
    return json_response(entry.response)


async def delete_response(request: web.Request) -> web.Response:
    """Delete a stored response; a running background one is cancelled first."""
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    owner = request.get(OWNER)
    run = request.app[BACKGROUND].get(response_id, owner)
    if run is not None:
        await run.cancel()
    if not state.store.delete(response_id, owner):
        raise _not_found(response_id)
    return json_response(ResponseDeleted(id=response_id))


def _cannot_cancel(status: str) -> APIError:
    return bad_request(f"Cannot cancel a {status} response.")


def _query_flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value in ("true", "1")


def _query_count(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdecimal() and len(value) <= 18):
        raise bad_request(f"{name} must be a sequence number (an integer >= 0)", name)
    return int(value)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"no stored response with id {response_id!r}", param=param, code="response_not_found"
    )
