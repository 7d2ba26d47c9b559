"""The asyncio-facing engine: ``add_request`` returns an async iterator of outputs.

The synchronous ``LLMEngine`` runs in its own thread so a forward pass never blocks the event
loop; the thread that built it frees its OpenMP workers for that thread
(engine/platform/cpu/openmp_pool.py). Requests and aborts reach that thread through the
engine loop's locked inbox (engine/engine_loop.py); outputs come back to each request's
``asyncio.Queue`` (engine/request_streams.py). Validation (tokenizing, length and capacity
checks, the waiting-queue limit) happens in the caller, so a bad request raises before any
stream starts.

If the engine loop itself dies, every stream in flight ends with ``EngineDeadError`` and
``is_alive`` turns False.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.engine_loop import EngineLoop, PendingAdd
from paged_serve.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from paged_serve.engine.grammar.compiles import GrammarCompiles
from paged_serve.engine.grammar.probe import ProbeBudget
from paged_serve.engine.grammar.structured_output import StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.lora.async_adapters import AsyncAdapters
from paged_serve.engine.lora.registry import lora_adapter
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.engine.observe.engine_snapshot import EngineSnapshot
from paged_serve.engine.observe.engine_state import EngineState, StateWatch
from paged_serve.engine.observe.metrics import EngineStats, SnapshotCollector
from paged_serve.engine.observe.weight_memory import WeightMemory
from paged_serve.engine.outputs import RequestOutput
from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.pooling_params import POOLING_SAMPLING, PoolingParams
from paged_serve.engine.request_streams import RequestStreams, Stream
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.admission import check_cache_salt
from paged_serve.engine.sched.forks import sample_ids


class AsyncEngine:
    """Owns an LLMEngine, the thread that steps it (``EngineLoop.run``) and the streams."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        max_waiting: int | None = None,
    ):
        self.engine = LLMEngine(config, loaded=loaded)
        self.max_waiting = max_waiting
        grammars = self.engine.grammars
        self.compiles = (
            GrammarCompiles(
                grammars,
                ProbeBudget(
                    cpu_s=config.grammar_compile_timeout_s,
                    memory_bytes=config.grammar_compile_memory,
                    fill_s=config.grammar_fill_timeout_s,
                ),
                config.max_pending_grammar_compiles,
            )
            if grammars is not None
            else None
        )
        self._streams = RequestStreams()
        self._loop = EngineLoop(self.engine, self._streams)
        self._ids = itertools.count()
        self.engine.stats.registry.register(SnapshotCollector(self.snapshot))
        # The engine thread's OpenMP pool must be the only one, or libgomp stops spinning
        # between parallel regions and every CPU step slows down
        # (engine/platform/cpu/openmp_pool.py).
        self.engine.platform.release_thread_pool()
        self._thread = threading.Thread(
            target=self._loop.run, name="paged-serve-engine", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------- public API
    @property
    def is_alive(self) -> bool:
        """The loop runs (and, under tensor parallelism, every worker process does)."""
        return self.dead is None and self._thread.is_alive() and self.engine.workers_alive

    @property
    def dead(self) -> BaseException | None:
        """What killed the engine loop (None while it lives)."""
        return self._loop.dead

    @property
    def state_watch(self) -> StateWatch:
        """When the dashboard's detailed state is taken (engine/observe/engine_state.py)."""
        return self._loop.state_watch

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The configuration the engine was built with."""
        return self.engine.config

    @property
    def model_config(self) -> object:
        """The model's ``transformers`` config (``model_type``, ``architectures``, ...)."""
        return self.engine.loaded.model.config

    @property
    def generation_config(self) -> object | None:
        """The model's ``transformers.GenerationConfig`` (None if it has none)."""
        return getattr(self.engine.loaded.model, "generation_config", None)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def weights(self) -> WeightMemory:
        """The model's weights in memory and how the checkpoint stores them."""
        return self.engine.weights

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the cache holds ``snapshot().kv_blocks_total`` of them)."""
        return self.engine.block_manager.block_size

    @property
    def stats(self) -> EngineStats:
        """Counters and latency histograms since start; ``stats.registry`` holds every metric
        ``/metrics`` reports, the snapshot's gauges included."""
        return self.engine.stats

    async def compile_grammar(self, constraint: StructuredOutput) -> None:
        """Compile a structured-output constraint into the engine's cache, within the budget
        (engine/grammar/compiles.py). Raises InvalidRequestError or CompileQueueFullError."""
        if self.compiles is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer")
        await self.compiles.compile(constraint)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return self.engine.tokenize(prompt)

    def multimodal_prompt(self, text: str, images: Sequence[object]) -> MultimodalPrompt:
        """``LLMEngine.multimodal_prompt``: CPU work, to be called off the event loop."""
        return self.engine.multimodal_prompt(text, images)

    @property
    def image_marker(self) -> str | None:
        """The text that stands for one image in a prompt (the processor's ``image_token``,
        LLaVA's ``<image>``); None for a model that takes no images."""
        loaded = self.engine.loaded
        if loaded.processor is None or self.engine.runner.encoder is None:
            return None
        return getattr(loaded.processor, "image_token", None)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int] | MultimodalPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        probe: bool = False,
        pooling: PoolingParams | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request; iterate the result for its outputs.

        With ``params.n > 1`` the outputs of all ``n`` samples arrive on the one iterator
        (``RequestOutput.index`` tells them apart) until every sample has finished.
        ``cache_salt``: the prefix-cache partition (``LLMEngine.add_request``). ``probe``: a
        health probe, never refused for a full waiting queue and never counted among the
        waiting requests ``max_waiting`` bounds (its caller keeps probes few: one at a time).
        Raises ValueError (bad request), QueueFullError or EngineDeadError before streaming.
        A ``MultimodalPrompt`` (``multimodal_prompt``) carries its images to the engine.
        Leaving the iteration early (or cancelling it) aborts every sample. ``pooling``: a
        pooling request (``pool`` below is the call to use). ``lora``: a served LoRA adapter's
        name (InvalidRequestError naming ``model`` when none is served by that name).
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        check_cache_salt(cache_salt)
        if lora is not None:
            lora_adapter(self.engine.loras, lora)
        ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, params, pooling)
        request_id = request_id or self.new_request_id()
        group = sample_ids(request_id, params.n)
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        loop = self._loop
        with loop.lock:
            # Checked again under the lock: the loop marks itself dead and shutdown() marks it
            # stopping under this lock, so a request either is registered before that (and gets
            # its error or abort) or is refused here; it never waits on a loop that is gone.
            if not loop.accepting:
                raise EngineDeadError("the engine loop is not running")
            if any(rid in self._streams for rid in group):
                raise ValueError(f"request id {request_id!r} is already in use")
            if not probe and self.max_waiting is not None:
                waiting = loop.num_waiting_counted()
                if waiting >= self.max_waiting:
                    raise QueueFullError(
                        f"{waiting} requests are already waiting (limit {self.max_waiting})"
                    )
            self._streams.open(group, stream, probe=probe)
            images = prompt if isinstance(prompt, MultimodalPrompt) else None
            add = PendingAdd(request_id, ids, params, cache_salt, probe, pooling, images, lora)
            loop.post(add)
        return self._iterate(group, stream)

    async def _iterate(self, group: list[str], stream: Stream) -> AsyncIterator[RequestOutput]:
        unfinished = set(group)
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in unfinished:
                self.abort(rid)

    @property
    def pooling(self) -> PoolingModel | None:
        """A pooling model's pipeline (what it answers, its sizes and prompts); None for a
        model that generates."""
        return self.engine.pooling

    async def pool(
        self,
        prompt: str | Sequence[int],
        params: PoolingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Run one pooling request to its end: its output's ``pooled`` is the embedding or
        the label scores (``finish_reason`` ``error`` when it failed, ``abort`` when the
        engine dropped it). ``cache_salt``: the prefix-cache partition, as for
        ``add_request``. Raises as ``add_request`` does, before anything runs; cancelling
        the call aborts the request."""
        stream = self.add_request(
            prompt, POOLING_SAMPLING, request_id, cache_salt=cache_salt, pooling=params
        )
        async for out in stream:
            if out.finished:
                return out
        raise EngineDeadError("the engine ended the request without an output")

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step runs."""
        self._loop.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        """The gauges as of the end of the last step (never waits for a running step).

        Requests added since count as waiting, including those the engine thread has taken
        from the inbox into the step now running: an idle snapshot means no request is live.
        """
        return self._loop.snapshot()

    def engine_state(self) -> EngineState | None:
        """The detailed state for the dashboard (``paged_serve.engine.observe.engine_state``); never
        waits for a step.

        Asking marks the state wanted, so the engine thread takes one after its steps for the
        next few seconds (at most every ``MIN_INTERVAL_S``). If the engine is between steps now
        (idle, for one) and the latest state is due, it is taken here. None until a first state
        exists (the engine thread takes one after its current step).
        """
        return self._loop.engine_state()

    @contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """Hold the engine thread between two steps and yield the engine to read (tests)."""
        with self._loop.between_steps() as engine:
            yield engine

    def check_integrity(self) -> None:
        """Check the block pool between steps (raises AssertionError on a leak or bad count)."""
        with self._loop.between_steps() as engine:
            engine.block_manager.check_integrity()
            engine.scheduler.check_adapter_slots()

    @property
    def loras(self) -> AsyncAdapters | None:
        """The served LoRA adapters, loaded and unloaded between steps (None without
        ``--enable-lora``)."""
        registry = self.engine.loras
        return None if registry is None else AsyncAdapters(registry, self._loop.between_steps)

    async def reset_prefix_cache(self) -> int | None:
        """Evict every cached prefix block, if no request is live (queued, running or on its
        way in); returns the blocks evicted, or None when busy (nothing is touched then: a
        running request's shared blocks keep their keys). Raises EngineDeadError.

        Never waits on a step: a live request answers None at once, and an idle engine's
        thread does the eviction between two steps while the caller awaits it. Taking the
        state lock here instead would hold the caller's event loop for as long as the step
        running then (a long prefill: seconds, with every stream and ``/health``).
        """
        flush = self._loop.ask_flush()
        if flush is None:
            return None
        return await asyncio.wrap_future(flush)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the loop thread."""
        self._loop.stop()
        self._thread.join(timeout)
        if self.compiles is not None:
            self.compiles.close()
        if not self._thread.is_alive():  # never pull the workers from under a running step
            self.engine.shutdown()
