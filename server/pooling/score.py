"""vLLM's ``POST /score``, and the pair scoring rerank shares (``score_pairs``).

How a pair is scored depends on the model:

* a classifier with one label (a cross-encoder, a Qwen3-Reranker scored from its yes/no
  logits): the pair is one input, the tokenizer's pair encoding (``inputs.tokenize_pairs``),
  and its score the label's activated score (the sigmoid of its logit, or of the yes-no logit
  difference; the logit itself with ``use_activation`` false). A classifier with more labels
  has no one score: 400, use ``/classify``. When the pairs share a first text of a KV block or
  more on a decoder that pools its last token (a rerank's query), the first pair runs alone
  and the others start from its cached blocks: the query's KV is computed once;
* an embedding model: the cosine similarity of the two texts' embeddings, each distinct text
  embedded once (a rerank's query once for all its documents), as sentence-transformers
  compares them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from aiohttp import web

from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.server.http.wire import json_response
from paged_serve.server.pooling.inputs import (
    PoolPrompt,
    read_body,
    side_prompts,
    tokenize_inputs,
    tokenize_pairs,
)
from paged_serve.server.pooling.run import data_list, pool_all, usage_of
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.pooling import PoolingUsage
from paged_serve.server.protocol.scoring import ScoreData, ScoreRequest
from paged_serve.server.state import OWNER, STATE, ServerState, tenant_cache_salt


@dataclass(frozen=True, slots=True)
class Scores:
    """One score per pair, in pair order, and the tokens run to get them."""

    scores: list[float]
    usage: PoolingUsage


async def score_pairs(
    state: ServerState,
    pooling: PoolingModel,
    pairs: Sequence[tuple[str, str]],
    reply_id: str,
    *,
    truncate: int | None,
    use_activation: bool | None,
    names: tuple[str, str],
    cache_salt: str | None,
) -> Scores:
    """Score every ``(first, second)`` pair (module docstring). ``names``: the request's
    fields of the first and second texts, which a 400 names (the second with its index);
    ``cache_salt``: the engine's prefix-cache salt (``run.pool_all``)."""
    if pooling.task == "classify":
        if pooling.size != 1:
            raise bad_request(
                f"scores need a model with one label (a cross-encoder or a reranker); this "
                f"model has {pooling.size} labels: use /classify",
                names[1],
            )
        prompts = await tokenize_pairs(
            state, pairs, truncate=truncate, token_types=pooling.token_types, param=names[1]
        )
        params = PoolingParams(task="classify", activation=use_activation is not False)
        outputs = await pool_all(
            state,
            reply_id,
            prompts,
            params,
            cache_salt=cache_salt,
            param=names[1],
            first_alone=_shares_cached_prefix(state, pooling, prompts),
        )
        return Scores([out.pooled[0] for out in outputs], usage_of(outputs))
    query_prompt, document_prompt = side_prompts(pooling)  # encode_query / encode_document's
    pairs = [(query_prompt + a, document_prompt + b) for a, b in pairs]
    one_first = len({first for first, _ in pairs}) == 1  # a rerank's query, one text_1
    where: dict[str, str] = {}  # each distinct text, with the field it first came from
    for i, (first, second) in enumerate(pairs):
        where.setdefault(first, names[0] if one_first else f"{names[0]}[{i}]")
        where.setdefault(second, f"{names[1]}[{i}]")
    texts = list(where)
    prompts = await tokenize_inputs(state, texts, truncate=truncate, names=list(where.values()))
    params = PoolingParams(task="embed")
    outputs = await pool_all(
        state, reply_id, prompts, params, cache_salt=cache_salt, param=names[1]
    )
    vectors = torch.tensor([out.pooled for out in outputs], dtype=torch.float64)
    row = {text: i for i, text in enumerate(texts)}
    left = vectors[[row[a] for a, _ in pairs]]
    right = vectors[[row[b] for _, b in pairs]]
    cosine = torch.nn.functional.cosine_similarity(left, right, dim=-1)
    return Scores(cosine.tolist(), usage_of(outputs))


def _shares_cached_prefix(
    state: ServerState, pooling: PoolingModel, prompts: Sequence[PoolPrompt]
) -> bool:
    """Whether the pairs start with a prefix of at least one KV block that the prefix cache
    can serve (a decoder pooling its last token, caching on): a rerank's query, or a score's
    one ``text_1``. Then the first pair runs alone and the others start from its blocks (the
    query's KV computed once), instead of all computing it side by side in one step."""
    engine = state.engine
    if len(prompts) < 2 or pooling.reads_every_token or not pooling.causal:
        return False
    if not engine.config.enable_prefix_caching:
        return False
    first = prompts[0].token_ids
    shared = min(len(first), *(len(p.token_ids) for p in prompts[1:]))
    for p in prompts[1:]:
        shared = next((i for i in range(shared) if p.token_ids[i] != first[i]), shared)
    return shared >= engine.block_size


async def create_score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pooling = state.pooling_model("/score")
    body = await read_body(request, ScoreRequest)
    reply_id = f"score-{uuid.uuid4().hex}"
    scored = await score_pairs(
        state,
        pooling,
        body.pairs(),
        reply_id,
        truncate=body.truncate_prompt_tokens,
        use_activation=body.use_activation,
        names=("text_1", "text_2"),
        cache_salt=tenant_cache_salt(request.get(OWNER), body.cache_salt),
    )
    data = [ScoreData(index=i, score=score) for i, score in enumerate(scored.scores)]
    return json_response(data_list(state, reply_id, data, scored.usage))
