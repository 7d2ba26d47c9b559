"""Rerank: ``POST /rerank`` and ``/v1/rerank`` (Jina's shape, as vLLM serves them) and
``POST /v2/rerank`` (Cohere's v2 shape): a query scored against each document
(``score.score_pairs``, the query first in every pair so that a decoder reranker's pairs share
its KV blocks through the prefix cache: the first pair runs alone, the others start from its
blocks), the results sorted by score, best first (a tie keeps the documents' order), the first
``top_n`` of them.

A result carries its document's text when ``return_documents`` asks, by default on ``/rerank``
and ``/v1/rerank`` (Jina, vLLM) and not on ``/v2/rerank`` (Cohere v2 results carry none).
"""

from __future__ import annotations

import uuid

from aiohttp import web
from msgspec import UNSET

from paged_serve.server.http.wire import json_response
from paged_serve.server.pooling.inputs import read_body
from paged_serve.server.pooling.score import score_pairs
from paged_serve.server.protocol.scoring import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
)
from paged_serve.server.state import OWNER, STATE, tenant_cache_salt


async def _rerank(request: web.Request, return_documents: bool) -> web.Response:
    state = request.app[STATE]
    pooling = state.pooling_model(request.path)
    body = await read_body(request, RerankRequest)
    documents = body.texts()
    reply_id = f"rerank-{uuid.uuid4().hex}"
    scored = await score_pairs(
        state,
        pooling,
        [(body.query, doc) for doc in documents],
        reply_id,
        truncate=body.truncate_prompt_tokens,
        use_activation=body.use_activation,
        names=("query", "documents"),
        cache_salt=tenant_cache_salt(request.get(OWNER), body.cache_salt),
    )
    scores = scored.scores
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties in order
    if body.top_n:
        order = order[: body.top_n]
    if body.return_documents is not None:
        return_documents = body.return_documents
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=documents[i]) if return_documents else UNSET,
            relevance_score=scores[i],
        )
        for i in order
    ]
    reply = RerankResponse(
        id=reply_id, model=state.served_model_name, usage=scored.usage, results=results
    )
    return json_response(reply)


async def rerank(request: web.Request) -> web.Response:
    """``/rerank``, ``/v1/rerank``: Jina's shape, documents returned by default."""
    return await _rerank(request, return_documents=True)


async def rerank_v2(request: web.Request) -> web.Response:
    """``/v2/rerank``: Cohere's v2 shape, no documents unless asked."""
    return await _rerank(request, return_documents=False)
