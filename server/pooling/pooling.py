"""vLLM's ``POST /pooling``: each input's pooled output as the model answers it, on any pooling
model: an embedding model's embedding (``dimensions`` and ``normalize`` as for
``/v1/embeddings``), a classifier's label scores (``use_activation`` false: the logits).

The reply is vLLM's: ``{"id", "object": "list", "created", "model", "data": [{"index",
"object": "pooling", "data": [...]}], "usage"}``, ``data`` as floats or, with
``encoding_format`` ``base64``, base64 of little-endian float32.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from paged_serve.server.http.wire import json_response
from paged_serve.server.pooling.embeddings import embed_params, encoded
from paged_serve.server.pooling.inputs import prompt_text, read_body
from paged_serve.server.pooling.run import data_list, pool_inputs, usage_of
from paged_serve.server.protocol.pooling import EmbeddingRequest, PoolingData
from paged_serve.server.state import OWNER, STATE


async def create_pooling(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pooling = state.pooling_model("/pooling")
    body = await read_body(request, EmbeddingRequest)
    params = embed_params(pooling, body)
    reply_id = f"pool-{uuid.uuid4().hex}"
    prompt = prompt_text(pooling, body.prompt_name) if pooling.task == "embed" else ""
    outputs = await pool_inputs(state, body, params, reply_id, request.get(OWNER), prompt)
    data = [
        PoolingData(index=i, data=encoded(out.pooled, body.encoding_format))
        for i, out in enumerate(outputs)
    ]
    return json_response(data_list(state, reply_id, data, usage_of(outputs)))
