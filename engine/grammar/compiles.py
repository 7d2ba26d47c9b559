"""Compiling structured-output constraints for the server: one at a time, within a budget,
merged when identical, dropped when nobody waits, refused when too many queue.

``GrammarCompiles.compile(constraint)`` (awaited by a request handler before it queues the
request) returns once the engine's ``GrammarCompiler`` holds the compiled grammar:

* a cached constraint returns at once; one refused earlier is refused again at once;
* identical constraints in flight share one compile (each waiter awaits the same future);
* a new distinct constraint beyond ``max_pending`` compiling or queued is a ``QueueFullError``
  (the server's 503);
* compiles run one at a time on one thread: first in the probe process under the budget
  (``engine/grammar/probe.py``: CPU-seconds, memory, per-token mask fill), then in the server,
  whose xgrammar uses one thread; the engine keeps the rest of the machine;
* a waiter that goes away (its client hung up, its handler was cancelled) leaves; when the last
  one leaves, a compile not yet started is dropped and a probe running is killed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.grammar.probe import GrammarProbe, ProbeBudget, ProbeCancelled
from paged_serve.engine.grammar.structured_output import GrammarCompiler, StructuredOutput

REFUSED_CACHE_SIZE = 256  # constraints refused, remembered so a repeat costs nothing


class CompileQueueFullError(RuntimeError):
    """More distinct constraints are compiling or queued than the server allows."""


@dataclass(slots=True)
class _Compile:
    """One constraint's compile: its result and who waits for it."""

    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0


class GrammarCompiles:
    """The server's compile queue for one engine's ``GrammarCompiler`` (thread-safe; usable
    from any event loop)."""

    def __init__(self, grammars: GrammarCompiler, budget: ProbeBudget, max_pending: int):
        self.grammars = grammars
        self.max_pending = max_pending
        self.probe = GrammarProbe(grammars.tokenizer_info_json, budget)
        self._lock = threading.Lock()
        self._jobs: dict[StructuredOutput, _Compile] = {}
        self._refused: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    async def compile(self, constraint: StructuredOutput) -> None:
        """Return once ``constraint`` is compiled and cached. Raises InvalidRequestError (it
        does not compile, admits nothing, or is past the budget) or CompileQueueFullError."""
        if self.grammars.is_cached(constraint):
            return
        job = self._join(constraint)
        try:
            await asyncio.shield(asyncio.wrap_future(job.future))
        finally:
            self._leave(constraint, job)

    def _join(self, constraint: StructuredOutput) -> _Compile:
        with self._lock:
            refused = self._refused.get(constraint)
            if refused is not None:
                raise InvalidRequestError(refused)
            job = self._jobs.get(constraint)
            if job is None:
                if len(self._jobs) >= self.max_pending:
                    raise CompileQueueFullError(
                        f"{len(self._jobs)} output constraints are already compiling or queued "
                        f"(limit {self.max_pending}; --max-pending-grammar-compiles)"
                    )
                job = self._jobs[constraint] = _Compile()
                self._pool.submit(self._run, constraint, job)
            job.waiters += 1
            return job

    def _leave(self, constraint: StructuredOutput, job: _Compile) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.done():
                job.cancelled.set()  # nobody waits: drop it, or stop its probe
                if self._jobs.get(constraint) is job:
                    del self._jobs[constraint]

    def _run(self, constraint: StructuredOutput, job: _Compile) -> None:
        """On the compile thread: probe, then compile into the engine's cache. The job leaves
        the queue before its waiters wake, so a waiter's next constraint finds room."""
        error: BaseException | None = None
        try:
            if job.cancelled.is_set():
                raise ProbeCancelled
            if not self.grammars.is_cached(constraint):
                self.probe.check(constraint, job.cancelled)
                self.grammars.compile(constraint)
        except BaseException as exc:  # noqa: BLE001  (handed to the waiters, who raise it)
            error = exc
        with self._lock:
            if self._jobs.get(constraint) is job:
                del self._jobs[constraint]
            if isinstance(error, InvalidRequestError):
                self._refused[constraint] = str(error)
                while len(self._refused) > REFUSED_CACHE_SIZE:
                    self._refused.popitem(last=False)
        _settle(job.future, error)

    def close(self) -> None:
        """Stop the probe and the compile thread; every waiter gets a RuntimeError (a compile
        in progress in the server finishes unwaited)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.cancelled.set()
            _settle(job.future, RuntimeError("the engine is shutting down"))
        self.probe.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(future: Future, error: BaseException | None) -> None:
    """Give ``future`` its result (None) or ``error``, unless it has one already."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:  # settled first by close()
        pass
