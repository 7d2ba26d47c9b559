"""vLLM's ``POST /classify``: each input's label scores on a classification model.

``probs`` are the engine's scores per label (softmax over the labels, or the sigmoid of a
single label's logit; the logits with ``use_activation`` false), ``label`` the best label's
name (the config's ``id2label``; a reranker scored from its LM head names its token),
``num_classes`` their count.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.server.http.wire import json_response
from paged_serve.server.pooling.inputs import read_body
from paged_serve.server.pooling.run import data_list, pool_inputs, usage_of
from paged_serve.server.protocol.pooling import ClassificationData, ClassifyRequest
from paged_serve.server.state import OWNER, STATE


def _label(labels: tuple[str, ...], probs: list[float]) -> str:
    best = max(range(len(probs)), key=probs.__getitem__)
    return labels[best] if best < len(labels) else f"LABEL_{best}"


async def create_classification(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pooling = state.pooling_model("/classify", "classify")
    body = await read_body(request, ClassifyRequest)
    params = PoolingParams(task="classify", activation=body.use_activation is not False)
    reply_id = f"classify-{uuid.uuid4().hex}"
    outputs = await pool_inputs(state, body, params, reply_id, request.get(OWNER))
    data = [
        ClassificationData(
            index=i,
            label=_label(pooling.labels, out.pooled),
            probs=out.pooled,
            num_classes=len(out.pooled),
        )
        for i, out in enumerate(outputs)
    ]
    return json_response(data_list(state, reply_id, data, usage_of(outputs)))
