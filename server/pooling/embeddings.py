"""``POST /v1/embeddings`` (OpenAI's shape, vLLM's extras): one embedding per input.

Each embedding is the engine's answer (``engine/pooling/pooling_model.py``): the pooled row
through the sentence-transformers Dense layers, its first ``dimensions`` lanes (a Matryoshka
model only: 400 otherwise), L2-normalized unless ``normalize`` is false. ``encoding_format``
``base64`` sends each as base64 of its little-endian float32 bytes, as OpenAI and vLLM do (the
openai SDK asks for base64 by default and decodes it itself). ``prompt_name``
(sentence-transformers' parameter) puts the folder's prompt of that name (Qwen3-Embedding's
"query" instruction) before each text, as ``SentenceTransformer.encode`` does; without it the
folder's ``default_prompt_name``, if any.
"""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Sequence

from aiohttp import web

from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.server.http.wire import json_response
from paged_serve.server.pooling.inputs import prompt_text, read_body
from paged_serve.server.pooling.run import data_list, pool_inputs, usage_of
from paged_serve.server.protocol.errors import bad_request
from paged_serve.server.protocol.pooling import EmbeddingData, EmbeddingRequest
from paged_serve.server.state import OWNER, STATE


def encoded(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """``values`` as floats, or as base64 of little-endian float32 (``base64``)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return list(values)


def embed_params(pooling: PoolingModel, body: EmbeddingRequest) -> PoolingParams:
    """The engine's params of an embeddings (or ``/pooling``) body for ``pooling``; 400 naming
    ``dimensions`` for what the model cannot answer (``PoolingModel.check``)."""
    if pooling.task != "embed":
        if body.dimensions is not None:
            raise bad_request(
                "dimensions: only an embedding model takes dimensions; this one is a classifier",
                "dimensions",
            )
        return PoolingParams(task="classify", activation=body.use_activation is not False)
    params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalized)
    try:
        pooling.check(params)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from None
    return params


async def create_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pooling = state.pooling_model("/v1/embeddings", "embed")
    body = await read_body(request, EmbeddingRequest)
    params = embed_params(pooling, body)
    reply_id = f"embd-{uuid.uuid4().hex}"
    prompt = prompt_text(pooling, body.prompt_name)
    outputs = await pool_inputs(state, body, params, reply_id, request.get(OWNER), prompt)
    data = [
        EmbeddingData(index=i, embedding=encoded(out.pooled, body.encoding_format))
        for i, out in enumerate(outputs)
    ]
    return json_response(data_list(state, reply_id, data, usage_of(outputs)))
