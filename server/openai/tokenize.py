"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: the served model's
tokenizer, with vLLM's request and response shapes (at the server root, as vLLM serves them).

``/tokenize`` takes either a completions ``prompt`` (a string; special tokens such as BOS added
by default) or chat ``messages`` (through the chat template, with the generation prompt by
default, special tokens not added again; their images, read and checked as chat completions
reads them, through the model's processor, so each counts as its placeholder tokens), and
answers ``{"count", "max_model_len", "tokens",
"token_strs"}``; the ids are exactly what ``/v1/completions`` or ``/v1/chat/completions`` would
run for the same input. ``/detokenize`` takes ``{"tokens": [...]}`` and answers
``{"prompt": text}``. ``/tokenizer_info`` describes the tokenizer (its class, special tokens and
chat template), which lm-evaluation-harness's remote tokenizer reads.
"""

from __future__ import annotations

from aiohttp import web

from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.server.generation.prompts import chat_message, chat_prompt, tokenize_prompt
from paged_serve.server.http.wire import json_response
from paged_serve.server.media.images import conversation_images
from paged_serve.server.protocol.decode import decode
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from paged_serve.server.state import STATE, ServerState


def _tokenizer(state: ServerState) -> object:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: it takes and returns token ids only")
    return tokenizer


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), TokenizeRequest)
    body.check()
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    if body.messages is not None:
        params = [f"messages[{i}]" for i in range(len(body.messages))]
        chat = await conversation_images(  # a chat's images count as its placeholders
            body.messages,
            params,
            marker=state.engine.image_marker,
            model=state.served_model_name,
            config=state.media,
        )
        messages = [chat_message(m.role, m.content, p) for m, p in zip(chat.messages, params)]
        prompt = await chat_prompt(
            state.engine,
            messages,
            "messages",
            images=chat.images,
            image_marker=chat.marker,
            add_generation_prompt=body.add_generation_prompt is not False,
            continue_final_message=bool(body.continue_final_message),
            add_special_tokens=bool(body.add_special_tokens),
        )
        ids = prompt.token_ids if isinstance(prompt, MultimodalPrompt) else prompt
    elif body.add_special_tokens is False:
        ids = list(tokenizer(body.prompt, add_special_tokens=False).input_ids)
    else:
        ids = await tokenize_prompt(state.engine, body.prompt, "prompt")  # as /v1/completions does
    token_strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return json_response(
        TokenizeResponse(
            count=len(ids), max_model_len=state.context_limit, tokens=ids, token_strs=token_strs
        )
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), DetokenizeRequest)
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    vocab_size = state.engine.vocab_size
    bad = [t for t in body.tokens if t >= vocab_size]
    if bad:
        raise bad_request(f"token {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return json_response(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)))


def _token(tokenizer: object, name: str) -> str | None:
    value = getattr(tokenizer, name, None)
    return None if value is None else str(value)


async def tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokenizer = _tokenizer(state)
    template = getattr(tokenizer, "chat_template", None)
    return json_response(
        TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__,
            bos_token=_token(tokenizer, "bos_token"),
            eos_token=_token(tokenizer, "eos_token"),
            pad_token=_token(tokenizer, "pad_token"),
            unk_token=_token(tokenizer, "unk_token"),
            chat_template=template if isinstance(template, str) else None,
            max_model_len=state.context_limit,
        )
    )


# Outside /v1, as vLLM serves them; with API keys they need one like every /v1 route.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def add_tokenizer_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
