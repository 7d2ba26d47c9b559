"""One API call's engine requests (one per prompt, each with its n samples), started together
and read as one stream of ``(choice index, RequestOutput)``.

The engine runs the n samples of a prompt as one request: the prompt is prefilled once and
forked (copy-on-write blocks); sample i draws with seed + i. Choice ``index`` =
prompt_index * n + sample_index.

``start_generation`` queues all the requests or none: a request the engine refuses (bad
prompt, full queue, dead engine) aborts the ones already queued and raises the matching
``APIError``. Use the result as a context manager: leaving it - normally, on an error, or when
aiohttp cancels the handler because the client went away - aborts every sample that has not
finished, so its KV blocks are freed before the engine's next step.

Each engine stream is read by a small pump task that forwards its outputs to one queue; the
consumer sees outputs in the order the engine produced them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from paged_serve.engine.async_engine import EngineDeadError, QueueFullError
from paged_serve.engine.multimodal_inputs import MultimodalPrompt
from paged_serve.engine.outputs import RequestOutput, TokenLogprob
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.forks import sample_ids
from paged_serve.server.protocol.errors import SERVER_ERROR, APIError, bad_request, queue_full
from paged_serve.server.state import ServerState, model_not_found

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request: a prompt and its ``params.n`` samples, choices ``first_index`` on."""

    first_index: int
    prompt_ids: list[int]
    params: SamplingParams
    images: MultimodalPrompt | None = None  # a prompt with images: its ids are prompt_ids


@dataclass(slots=True)
class Choice:
    """Everything one sample produced, accumulated over its outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when the request asked

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


class Generation:
    """Started engine requests; iterate ``outputs()`` or await ``collect()``, then close."""

    def __init__(
        self,
        state: ServerState,
        num_choices: int,
        cache_salt: str | None = None,
        probe: bool = False,
        lora: str | None = None,
    ):
        self._state = state
        self._cache_salt = cache_salt  # the engine's salt: tenant and request (state.py)
        self._lora = lora  # the served LoRA adapter every request runs on (None: the base)
        self._probe = probe  # a health probe: outside --max-waiting (AsyncEngine.add_request)
        self._sample_ids: list[str] = []  # every sample of every started request
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self.output_tokens: dict[int, int] = dict.fromkeys(range(num_choices), 0)
        # per started request (by its first choice index): prompt tokens the prefix cache served
        self._cached_tokens: dict[int, int] = {}

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def completion_tokens(self) -> int:
        return sum(self.output_tokens.values())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, once per prompt (its samples share it)."""
        return sum(self._cached_tokens.values())

    def start(self, job: Job, request_id: str) -> None:
        """Queue ``job`` in the engine (raises what ``AsyncEngine.add_request`` raises)."""
        stream = self._state.engine.add_request(
            job.images or job.prompt_ids,
            job.params,
            request_id,
            cache_salt=self._cache_salt,
            probe=self._probe,
            lora=self._lora,
        )
        ids = sample_ids(request_id, job.params.n)
        self._sample_ids += ids
        self._cached_tokens[job.first_index] = 0
        self._state.in_flight.update(ids)

        async def pump() -> None:
            try:
                async for out in stream:
                    self._queue.put_nowait((job.first_index + out.index, out))
            except Exception as exc:  # handed to the consumer, which reports it
                self._queue.put_nowait((job.first_index, exc))

        self._pumps.append(asyncio.get_running_loop().create_task(pump()))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every sample until all have finished.

        Raises APIError if the engine dies (503), a request fails inside the engine (500), or
        the server aborts a request (503, shutdown); anything else propagates as it is.
        """
        remaining = len(self.output_tokens)
        while remaining:
            index, item = await self._queue.get()
            if isinstance(item, EngineDeadError):
                raise engine_dead(item)
            if isinstance(item, Exception):
                raise item
            self.output_tokens[index] = item.num_output_tokens
            if index in self._cached_tokens:
                self._cached_tokens[index] = item.num_cached_tokens
            if item.finished:
                remaining -= 1
                if item.finish_reason == "abort":
                    raise self._aborted()
                if item.finish_reason == "error":
                    logger.error("request %s failed in the engine: %s", item.request_id, item.error)
                    raise APIError(
                        500,
                        f"the request failed inside the engine ({item.error})",
                        type=SERVER_ERROR,
                        code="generation_failed",
                    )
            yield index, item

    async def collect(self) -> list[Choice]:
        """Run every sample to its end; the choices in index order."""
        choices = {index: Choice(index) for index in self.output_tokens}
        async for index, out in self.outputs():
            choices[index].add(out)
        return [choices[index] for index in sorted(choices)]

    def close(self) -> None:
        """Stop reading and abort whatever has not finished (idempotent).

        Aborting by id, not only by closing the engine's iterators, matters: a pump cancelled
        before its first step never started its iterator, whose own cleanup would not run.
        """
        for task in self._pumps:
            task.cancel()
        engine = self._state.engine
        for request_id in self._sample_ids:
            engine.abort(request_id)  # a no-op for a sample that already finished
            self._state.in_flight.discard(request_id)

    def _aborted(self) -> APIError:
        reason = "the server is shutting down" if self._state.shutting_down else "it was aborted"
        return APIError(
            503, f"the request did not finish: {reason}", type=SERVER_ERROR, code="request_aborted"
        )


def start_generation(
    state: ServerState,
    id_prefix: str,
    jobs: list[Job],
    prompt_param: str,
    *,
    cache_salt: str | None,
    probe: bool = False,
    lora: str | None = None,
) -> Generation:
    """Queue every job in the engine, or none; raises APIError (400/503) for a refused one.

    ``cache_salt`` is the engine's prefix-cache salt (``state.tenant_cache_salt``): required,
    so that no endpoint forgets its tenant and serves one key's prefixes to another. ``probe``
    marks ``/health_generate``'s request, which ``--max-waiting`` neither refuses nor counts.
    ``lora``: the served LoRA adapter to run on (``ServerState.lora_for``); one unloaded since
    the request was read is a 404, as any model not served.
    """
    if state.shutting_down:
        raise APIError(
            503, "the server is shutting down", type=SERVER_ERROR, code="server_shutting_down"
        )
    generation = Generation(state, sum(job.params.n for job in jobs), cache_salt, probe, lora)
    try:
        for job in jobs:
            generation.start(job, f"{id_prefix}-{job.first_index}")
    except ValueError as exc:
        generation.close()
        if lora is not None and getattr(exc, "param", None) == "model":
            raise model_not_found(lora, state.model_names + state.adapter_names()) from None
        # The engine names the field at fault where it is not the prompt (InvalidRequestError).
        raise bad_request(str(exc), getattr(exc, "param", None) or prompt_param) from None
    except QueueFullError as exc:
        generation.close()
        raise queue_full(exc) from None
    except EngineDeadError as exc:
        generation.close()
        raise engine_dead(exc) from None
    return generation


def engine_dead(exc: EngineDeadError) -> APIError:
    # The cause (the exception that killed the loop) goes to the log only: its text can hold
    # internal paths and device details that are no business of a client.
    logger.error("the engine is not running: %s", exc)
    return APIError(
        503, "the engine is not running; see the server log", type=SERVER_ERROR, code="engine_dead"
    )
