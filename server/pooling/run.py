"""One pooling call's engine requests: every input an ``AsyncEngine.pool`` request, all started
together so the engine batches them, awaited together (``pool_all``; ``pool_inputs`` tokenizes
an ``input`` list first), and the list reply most endpoints answer with (``data_list``).

The handlers check what they can before this (the model's kind, the inputs' lengths and
vocabulary, ``PoolingModel.check``), so the engine refuses little here; what it does refuse
(a full waiting queue, a dead engine) is the matching ``APIError``. The first failure - a
refusal, an input that fails inside the engine, an abort - cancels the others, and so does
the client going away (aiohttp cancels the handler): cancelling ``AsyncEngine.pool`` aborts
its request, and every id is aborted once more on the way out, so no request outlives its
call and its KV blocks are freed before the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TypeVar

from paged_serve.engine.async_engine import EngineDeadError, QueueFullError
from paged_serve.engine.outputs import RequestOutput
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.server.generation.run import engine_dead
from paged_serve.server.pooling.inputs import PoolPrompt, tokenize_inputs
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError, bad_request, queue_full
from paged_serve.server.protocol.pooling import DataList, PoolingRequestFields, PoolingUsage
from paged_serve.server.state import ServerState, tenant_cache_salt

logger = logging.getLogger(__name__)
DataT = TypeVar("DataT")


async def pool_all(
    state: ServerState,
    id_prefix: str,
    prompts: Sequence[PoolPrompt],
    params: PoolingParams,
    *,
    cache_salt: str | None,
    param: str = "input",
    first_alone: bool = False,
) -> list[RequestOutput]:
    """Run every prompt with ``params`` (its own segment ids added); the finished outputs in
    prompt order. ``cache_salt`` is the engine's prefix-cache salt
    (``state.tenant_cache_salt``; required, as for ``start_generation``: a decoder's last-token
    pooling takes prefix-cache hits, whose timing must not tell one key what another sent).
    ``first_alone``: run the first prompt to its end before the others start, so that a
    prefix they share with it is in the prefix cache when they are admitted (prompts admitted
    in one step would each compute it). Raises APIError: 400 (naming ``param``) for a prompt
    the engine refuses, 503 when the queue is full, the engine dead or the server shutting
    down, 500 for an input that failed inside the engine."""
    if state.shutting_down:
        raise APIError(
            503, "the server is shutting down", type=SERVER_ERROR, code="server_shutting_down"
        )
    engine = state.engine
    ids = [f"{id_prefix}-{i}" for i in range(len(prompts))]

    async def run(prompt: PoolPrompt, request_id: str) -> RequestOutput:
        p = params
        if prompt.token_type_ids is not None:
            p = dataclasses.replace(params, token_type_ids=prompt.token_type_ids)
        out = await engine.pool(prompt.token_ids, p, request_id, cache_salt=cache_salt)
        if out.finish_reason == "abort":
            reason = "the server is shutting down" if state.shutting_down else "it was aborted"
            raise APIError(
                503,
                f"the request did not finish: {reason}",
                type=SERVER_ERROR,
                code="request_aborted",
            )
        if out.finish_reason != "stop" or out.pooled is None:
            logger.error("request %s failed in the engine: %s", request_id, out.error)
            raise APIError(
                500,
                f"the request failed inside the engine ({out.error})",
                type=SERVER_ERROR,
                code="pooling_failed",
            )
        return out

    state.in_flight.update(ids)
    tasks: list[asyncio.Future[RequestOutput]] = []
    try:
        if first_alone:
            tasks.append(asyncio.ensure_future(run(prompts[0], ids[0])))
            await tasks[0]
        for prompt, request_id in list(zip(prompts, ids))[len(tasks) :]:
            tasks.append(asyncio.ensure_future(run(prompt, request_id)))
        return list(await asyncio.gather(*tasks))
    except ValueError as exc:  # refused by the engine's own checks
        raise bad_request(str(exc), getattr(exc, "param", None) or param) from None
    except QueueFullError as exc:
        raise queue_full(exc) from None
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    finally:
        for task in tasks:
            task.cancel()
        # the cancelled inputs end before the reply goes out (their aborts are below)
        await asyncio.gather(*tasks, return_exceptions=True)
        for request_id in ids:
            engine.abort(request_id)  # a no-op for a request that finished
            state.in_flight.discard(request_id)


def usage_of(outputs: Sequence[RequestOutput]) -> PoolingUsage:
    """The prompt tokens the outputs ran (nothing is generated: total = prompt)."""
    tokens = sum(out.num_prompt_tokens for out in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


async def pool_inputs(
    state: ServerState,
    body: PoolingRequestFields,
    params: PoolingParams,
    reply_id: str,
    owner: str | None,
    prompt: str = "",
) -> list[RequestOutput]:
    """``body.input`` tokenized (``tokenize_inputs``, text inputs after ``prompt``) and run
    with ``params``, in the prefix cache of ``owner`` (the API key's digest) and the body's
    ``cache_salt``."""
    prompts = await tokenize_inputs(
        state,
        body.inputs(),
        truncate=body.truncate_prompt_tokens,
        add_special_tokens=body.add_special_tokens,
        prompt=prompt,
    )
    salt = tenant_cache_salt(owner, body.cache_salt)
    return await pool_all(state, reply_id, prompts, params, cache_salt=salt)


def data_list(
    state: ServerState, reply_id: str, data: list[DataT], usage: PoolingUsage
) -> DataList[DataT]:
    """The list reply: ``data`` with the served name and the time now."""
    return DataList(
        id=reply_id, created=int(time.time()), model=state.served_model_name, data=data, usage=usage
    )
