"""What a router asks of the workers behind it: SGLang's worker endpoints, and vLLM's cache reset.

The routers users put in front of several servers (SGLang's model gateway, ``sglang-router``;
``vllm-router``) register a worker by URL, then read and drive it over plain HTTP::

    GET  /health_generate     200 once a one-token generation (on a pooling model: a one-token
                              pooling request) came back (503 otherwise)
    GET  /server_info         the serving limits: model, served name, KV tokens, batch sizes
    GET  /model_info          the model: path, type, architectures, is_generation
    GET  /get_load            [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}] now
    POST /flush_cache         evict every cached prefix block (400 while requests are live)
    POST /reset_prefix_cache  the same, under vLLM's name

(``/get_server_info`` and ``/get_model_info`` are the older names of the two info routes, as
SGLang's own server keeps them.) ``/health`` stays the cheap liveness probe routers poll; the
info and load routes are read-only figures, open as ``/metrics`` is. ``/health_generate`` runs
the model and the two cache routes change the engine's state: with API keys those three need
one (``KEYED_PATHS``). Concurrent ``/health_generate`` callers share one in-flight probe
(``SharedProbe``): a loop of them costs one engine request at a time, which ``--max-waiting``
neither refuses nor counts, so probes never take a queue slot from a client.

``/get_load``'s ``num_tokens`` is the KV cache in use, in tokens (blocks held by live requests
times the block size), which ``power_of_two`` routing compares between workers.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata

from aiohttp import web

from paged_serve.engine.async_engine import EngineDeadError
from paged_serve.engine.pooling_params import POOLING_SAMPLING, PoolingParams
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.generation.run import Job, engine_dead, start_generation
from paged_serve.server.http.wire import json_response
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError
from paged_serve.server.protocol.ops import FlushResult, LoadInfo, ModelInfo, ServerInfo
from paged_serve.server.state import STATE, ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0  # seconds a one-token health generation may take
CACHE_PATHS = frozenset({"/flush_cache", "/reset_prefix_cache"})
KEYED_PATHS = CACHE_PATHS | {"/health_generate"}  # need the API key when the server has keys


@functools.cache
def package_version() -> str:
    """The installed paged-serve's version (``unknown`` when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("paged-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_path(state: ServerState) -> str:
    """What the server was started on: the model argument, or the default model's name."""
    return state.engine.config.model or state.engine.model_name


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine, config = state.engine, state.engine.config
    path = model_path(state)
    return json_response(
        ServerInfo(
            model_path=path,
            tokenizer_path=path,
            served_model_name=state.served_model_name,
            version=package_version(),
            tp_size=config.tensor_parallel_size,
            max_total_tokens=engine.snapshot().kv_blocks_total * engine.block_size,
            max_running_requests=config.max_num_seqs,
            max_prefill_tokens=config.max_num_batched_tokens,
            max_model_len=state.context_limit,
            page_size=engine.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
    )


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    hf_config = state.engine.model_config
    path = model_path(state)
    architectures = getattr(hf_config, "architectures", None)
    return json_response(
        ModelInfo(
            model_path=path,
            tokenizer_path=path,
            served_model_name=state.served_model_name,
            is_generation=state.engine.pooling is None,
            model_type=getattr(hf_config, "model_type", None),
            architectures=list(architectures) if architectures else None,
        )
    )


async def get_load(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    snap = engine.snapshot()
    load = LoadInfo(
        num_reqs=snap.num_running + snap.num_waiting,
        num_waiting_reqs=snap.num_waiting,
        num_tokens=snap.kv_blocks_used * engine.block_size,
    )
    return json_response([load])


class SharedProbe:
    """The one-token generation ``/health_generate`` answers from, shared by every caller that
    arrives while it runs. Event loop only.

    The probe runs in a task of its own, so a caller that goes away (its handler cancelled)
    neither aborts it for the others nor leaves it half done; each caller waits on it shielded.
    """

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self.num_started = 0  # probes run so far (each one engine request)

    async def wait(self, state: ServerState) -> None:
        """Return once a probe started now or earlier (still running) generated its token;
        APIError (503) when it failed or took over ``HEALTH_GENERATE_TIMEOUT_S``."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(_probe(state))
            # a failure nobody waits for any more is still retrieved (no "never retrieved" log)
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self.num_started += 1
        await asyncio.shield(self._task)


async def _probe(state: ServerState) -> None:
    if state.engine.pooling is not None:
        await _pooling_probe(state)
        return
    job = Job(0, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    request_id = state.engine.new_request_id("health")
    with start_generation(state, request_id, [job], "prompt", cache_salt=None, probe=True) as gen:
        try:
            await asyncio.wait_for(gen.collect(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _unresponsive("a one-token generation") from None


async def _pooling_probe(state: ServerState) -> None:
    """A pooling model's probe: the one-token prompt pooled (a model that only pools cannot
    generate), outside ``--max-waiting`` like the generation probe."""
    engine = state.engine
    request_id = engine.new_request_id("health")
    params = PoolingParams(task=engine.pooling.task)
    try:
        outputs = engine.add_request([0], POOLING_SAMPLING, request_id, probe=True, pooling=params)
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    state.in_flight.add(request_id)

    async def finish() -> None:
        async for out in outputs:
            if out.finished and out.finish_reason != "stop":
                raise APIError(
                    503,
                    f"the health probe did not finish ({out.finish_reason})",
                    type=SERVER_ERROR,
                    code="engine_unresponsive",
                )

    try:
        await asyncio.wait_for(finish(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise _unresponsive("a one-token pooling request") from None
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    finally:
        engine.abort(request_id)  # a no-op once it finished
        state.in_flight.discard(request_id)


def _unresponsive(what: str) -> APIError:
    return APIError(
        503,
        f"{what} took over {HEALTH_GENERATE_TIMEOUT_S:g} s",
        type=SERVER_ERROR,
        code="engine_unresponsive",
    )


async def health_generate(request: web.Request) -> web.Response:
    """200 once a one-token greedy generation of a one-token prompt (a pooling model: its
    pooling) came back: the engine steps, not only its thread lives. It is an ordinary request
    (counted in the metrics), except that callers share it while it runs and ``--max-waiting``
    does not apply to it."""
    state = request.app[STATE]
    state.check_engine_alive()
    await request.app[HEALTH_PROBE].wait(state)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """Evict every cached prefix block; refused (400, nothing touched) while a request is live,
    as SGLang refuses (vLLM's reset fails the same way). Answered at once either way: the
    engine's thread evicts between two steps while this handler awaits it."""
    state = request.app[STATE]
    try:
        evicted = await state.engine.reset_prefix_cache()
    except EngineDeadError as exc:
        raise engine_dead(exc) from None
    if evicted is None:
        raise APIError(
            400,
            "the prefix cache was not flushed: requests are running; retry when the server is idle",
            code="server_busy",
        )
    return json_response(FlushResult(message="Cache flushed.", evicted_blocks=evicted))


HEALTH_PROBE = web.AppKey("paged_serve_health_probe", SharedProbe)


def add_worker_routes(app: web.Application) -> None:
    app[HEALTH_PROBE] = SharedProbe()
    app.router.add_get("/health_generate", health_generate)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    for path in sorted(CACHE_PATHS):
        app.router.add_post(path, flush_cache)
