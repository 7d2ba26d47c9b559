"""A pooling request's body and inputs: decoded and checked, then texts (and text pairs) to the
token ids each engine request runs, off the event loop.

Texts are tokenized with the model's tokenizer, special tokens added unless
``add_special_tokens`` is false; token-id inputs are checked against the vocabulary. A pair
(``/score``, rerank on a cross-encoder or reranker) is ONE input, the tokenizer's pair encoding
``tokenizer(text_1, text_2)``: a BERT cross-encoder's ``[CLS] a [SEP] b [SEP]`` with its segment
ids, a decoder's two texts one after the other (the first, a rerank's query, shared by every
pair: its KV blocks are cached once).

An input longer than the context (the model's, or the KV cache if smaller) is a 400 naming
it, unless ``truncate_prompt_tokens`` asks for a cut: a single input keeps its last N tokens
(vLLM's way; a text keeps the special tokens around it, ``[CLS]`` and ``[SEP]``, a BOS or an
EOS, as a tokenizer truncating from the left does); a pair is cut by the tokenizer's own pair
truncation (the longer text first, from its end, as sentence-transformers' CrossEncoder cuts),
so the query and the special tokens stay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.server.generation.prompts import check_text_length, off_loop
from paged_serve.server.protocol.decode import decode
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.state import STATE, ServerState

BodyT = TypeVar("BodyT")


# sentence-transformers' names of a document's prompt, in the order encode_document tries them
DOCUMENT_PROMPTS = ("document", "passage", "corpus")


def prompt_text(pooling: PoolingModel, name: str | None, param: str = "prompt_name") -> str:
    """The sentence-transformers prompt ``name`` of the model's folder (Qwen3-Embedding's
    "query" instruction), put before each text input as ``SentenceTransformer.encode`` puts
    it; None takes the folder's ``default_prompt_name`` (none: no prompt). 400 naming
    ``param`` for a name the folder does not have."""
    name = name if name is not None else pooling.default_prompt_name
    if name is None:
        return ""
    if name not in pooling.prompts:
        known = ", ".join(sorted(pooling.prompts)) or "none"
        raise bad_request(f"{param}: this model has no prompt {name!r} (it has: {known})", param)
    return pooling.prompts[name]


def side_prompts(pooling: PoolingModel) -> tuple[str, str]:
    """The prompts of a query and of a document, as sentence-transformers' ``encode_query``
    and ``encode_document`` pick them ("query"; "document", "passage" or "corpus"; else the
    default prompt)."""
    query = "query" if "query" in pooling.prompts else None
    document = next((n for n in DOCUMENT_PROMPTS if n in pooling.prompts), None)
    return prompt_text(pooling, query), prompt_text(pooling, document)


@dataclass(frozen=True, slots=True)
class PoolPrompt:
    """One engine request's prompt: its token ids and, for a model that reads them, its
    segment ids (one per token)."""

    token_ids: list[int]
    token_type_ids: tuple[int, ...] | None = None


async def read_body(request: web.Request, type: type[BodyT]) -> BodyT:
    """The body as ``type``, decoded once, checked (``check()``), naming a served model."""
    body = decode(await request.read(), type)
    body.check()  # type: ignore[attr-defined]
    request.app[STATE].check_model(body.model)  # type: ignore[attr-defined]
    return body


def _kept(state: ServerState, truncate: int | None) -> int | None:
    """Tokens an input may keep: None without truncation; 400 for a cut beyond the context."""
    context = state.context_limit
    if truncate is None:
        return None
    if truncate == -1:
        return context
    if truncate > context:
        raise bad_request(
            f"truncate_prompt_tokens is {truncate}, more than this model's context of "
            f"{context} tokens",
            "truncate_prompt_tokens",
        )
    return truncate


def _fitted(ids: list[int], context: int, param: str) -> list[int]:
    """``ids`` when they fit the context; 400 naming ``param`` when empty or too long."""
    if not ids:
        raise bad_request(f"{param} has no tokens", param)
    if len(ids) > context:
        raise bad_request(
            f"{param} has {len(ids)} tokens; this model's context is {context} tokens (send "
            "truncate_prompt_tokens to cut inputs to fit)",
            param,
            "context_length_exceeded",
        )
    return ids


def _tokenizer(state: ServerState) -> object:
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send token ids", "input")
    return tokenizer


async def tokenize_inputs(
    state: ServerState,
    inputs: Sequence[str | list[int]],
    *,
    truncate: int | None,
    add_special_tokens: bool = True,
    names: Sequence[str] | None = None,
    prompt: str = "",
) -> list[PoolPrompt]:
    """Each input's token ids (texts tokenized in one batch, off the event loop, each after
    ``prompt``: ``prompt_text``), cut to the last ``truncate`` tokens where asked; 400 naming
    the input (``names[i]``; by default ``input``, or ``input[i]`` in a list)."""
    engine = state.engine
    keep = _kept(state, truncate)

    def param(i: int) -> str:
        if names is not None:
            return names[i]
        return "input" if len(inputs) == 1 else f"input[{i}]"

    texts = {i: prompt + t for i, t in enumerate(inputs) if isinstance(t, str)}
    encoded: dict[int, list[int]] = {}
    if texts:
        tokenizer = _tokenizer(state)
        if keep is None:  # a cut input may be as long as the body allows
            for i, text in texts.items():
                check_text_length(engine, len(text), param(i))

        def tokenize() -> list[list[int]]:
            batch = tokenizer(
                list(texts.values()),
                add_special_tokens=add_special_tokens,
                return_special_tokens_mask=keep is not None,
            )
            if keep is None:
                return [list(ids) for ids in batch.input_ids]
            return [
                _cut(ids, m, keep) for ids, m in zip(batch.input_ids, batch.special_tokens_mask)
            ]

        encoded = dict(zip(texts, await off_loop(tokenize)))
    vocab_size, context = engine.vocab_size, state.context_limit
    prompts = []
    for i, item in enumerate(inputs):
        ids = encoded.get(i)
        if ids is None:  # token ids: checked, cut as they are
            ids = list(item)
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise bad_request(
                    f"{param(i)}: token {bad[0]} is outside the vocabulary [0, {vocab_size})",
                    param(i),
                )
            if keep is not None:
                ids = ids[-keep:]
        prompts.append(PoolPrompt(_fitted(ids, context, param(i))))
    return prompts


def _cut(ids: Sequence[int], special: Sequence[int], keep: int) -> list[int]:
    """A text's ``ids`` cut to ``keep`` tokens, the text's last ones between the special tokens
    the tokenizer put around it (``special``: its special-tokens mask), as a tokenizer
    truncating from the left keeps them: BERT's ``[CLS]``, a decoder's BOS or EOS stay."""
    if len(ids) <= keep:
        return list(ids)
    head = next((i for i, s in enumerate(special) if not s), len(ids))
    tail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    room = keep - head - tail
    if room < 1:
        raise bad_request(
            f"truncate_prompt_tokens is {keep}, which leaves no room for text beside the "
            f"{head + tail} special tokens the tokenizer adds",
            "truncate_prompt_tokens",
        )
    return [*ids[:head], *ids[len(ids) - tail - room : len(ids) - tail], *ids[len(ids) - tail :]]


async def tokenize_pairs(
    state: ServerState,
    pairs: Sequence[tuple[str, str]],
    *,
    truncate: int | None,
    token_types: bool,
    param: str,
) -> list[PoolPrompt]:
    """Each pair's encoding (module docstring), with its segment ids when ``token_types``;
    400 naming ``param`` (``text_2`` or ``documents``, with the pair's index)."""
    tokenizer = _tokenizer(state)
    keep = _kept(state, truncate)
    engine = state.engine
    if keep is None:
        for i, (a, b) in enumerate(pairs):
            check_text_length(engine, len(a) + len(b), f"{param}[{i}]")
    cut = {} if keep is None else {"truncation": True, "max_length": keep}

    def tokenize() -> tuple[list[list[int]], list[list[int]] | None]:
        batch = tokenizer(
            [a for a, _ in pairs],
            [b for _, b in pairs],
            return_token_type_ids=token_types,
            **cut,
        )
        types = [list(t) for t in batch.token_type_ids] if token_types else None
        return [list(ids) for ids in batch.input_ids], types

    ids_list, types_list = await off_loop(tokenize)
    context = state.context_limit
    prompts = []
    for i, ids in enumerate(ids_list):
        types = tuple(types_list[i]) if types_list is not None else None
        prompts.append(PoolPrompt(_fitted(ids, context, f"{param}[{i}]"), types))
    return prompts
