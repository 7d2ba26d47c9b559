"""The output side of a step: each sampled token appended to its request, the detokenizer and
stop checks run, and a request that is done finished (its blocks freed, its metrics observed).

``StepOutputs`` holds the live requests by id (``live``); ``LLMEngine`` adds to it, and every
request leaves it through ``finish``. One request's fault (a detokenizer that raises, a grammar
that refuses a token, a row without a usable logit, a mask past its budget) ends that request
alone with ``finish_reason="error"``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from paged_serve.engine.observe.metrics import EngineStats
from paged_serve.engine.outputs import RequestOutput, TokenLogprob
from paged_serve.engine.sample.sampler import INVALID_TOKEN
from paged_serve.engine.sched.batch import ScheduledBatch, StepResult
from paged_serve.engine.sched.forks import with_pending_forks
from paged_serve.engine.sched.live_request import LiveRequest, request_metrics
from paged_serve.engine.sched.request import Request
from paged_serve.engine.sched.scheduler import Scheduler

logger = logging.getLogger("paged_serve.engine.llm_engine")


class StepOutputs:
    """Appends each step's tokens and finishes requests; ``eos_token_ids`` and
    ``max_model_len`` (tokens) are the stop checks' limits."""

    def __init__(
        self,
        scheduler: Scheduler,
        stats: EngineStats,
        *,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ):
        self.scheduler = scheduler
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.live: dict[str, LiveRequest] = {}

    def fail_step(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        """Finish every request of a step that could not run (and the forks waiting on them)
        with ``finish_reason="error"``; their blocks return to the pool."""
        now = time.monotonic()
        doomed = with_pending_forks(s.request for s in batch.requests)
        return [
            self.finish(self.live[r.request_id], "error", now=now, error=message)
            for r in doomed
            if r.request_id in self.live
        ]

    def process(
        self, result: StepResult, accepted: dict[str, int] | None = None
    ) -> list[RequestOutput]:
        """Each sampled token to its request: an output for every request that produced a
        token or ended. ``accepted``: per drafted request id, the drafts its rows confirmed;
        such a request has ``len(draft) + 1`` consecutive rows and emits the first
        ``accepted + 1`` of them (``engine/sample/sampling_rows.py``)."""
        accepted = accepted or {}
        now = time.monotonic()
        outputs = [self._pooled(rid, data, now) for rid, data in result.pooled.items()]
        i = 0
        while i < len(result.request_ids):
            request_id = result.request_ids[i]
            rows = 1
            while i + rows < len(result.request_ids) and result.request_ids[i + rows] == request_id:
                rows += 1
            live = self.live[request_id]
            try:
                emit = range(i, i + accepted.get(request_id, 0) + 1)
                outputs.append(self._tokens(live, result, emit, now))
            except Exception as exc:  # one request's fault must not stop the others
                logger.exception("request %s failed while processing its output", request_id)
                live.forget_text()  # never touch a detokenizer that raised again
                error = f"internal error: {type(exc).__name__}"
                outputs.append(self.finish(live, "error", now=now, error=error))
            i += rows
        return outputs

    def _pooled(self, request_id: str, data: list[float], now: float) -> RequestOutput:
        """A pooling request whose prompt this step completed: done, with its answer."""
        return self.finish(self.live[request_id], "stop", now=now, pooled=data)

    def _tokens(
        self, live: LiveRequest, result: StepResult, rows: range, now: float
    ) -> RequestOutput:
        """Append the tokens of ``rows`` in order, detokenize, and decide whether the request
        is done (at the first token that ends it: the rest are dropped)."""
        req = live.request
        if req.params.max_tokens == 0:  # scoring only: the prompt is done, nothing to generate
            return self.finish(live, "length", now=now)
        # its grammar mask outran the budget at that row (engine/sample/token_mask.py); a
        # drafted request emits the rows before it, as it would have without drafts
        failed_row, failure = result.failed.get(req.request_id, (None, None))
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if req.params.logprobs is not None else None
        for position, i in enumerate(rows):
            if position == failed_row:
                logger.warning("request %s: %s", req.request_id, failure)
                if tokens:
                    self._timed(req, tokens, now)
                return self.finish(
                    live, "error", now=now, tokens=tokens, logprobs=logprobs, error=failure
                )
            token = result.token_ids[i]
            error = self._refusal(req, token)
            if error is not None:  # the tokens before it stand
                if tokens:
                    self._timed(req, tokens, now)
                return self.finish(
                    live, "error", now=now, tokens=tokens, logprobs=logprobs, error=error
                )
            if req.deferred_matcher is not None and token == req.params.structured_output_after:
                req.matcher, req.deferred_matcher = req.deferred_matcher, None  # from the next
            req.output_token_ids.append(token)
            tokens.append(token)
            if logprobs is not None:
                top = result.top_logprobs[i][: req.params.logprobs]
                logprobs.append(TokenLogprob(token, result.logprobs[i], top))
            reason, stop_reason = live.stop_reason(
                token, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
            )
            if reason is not None:
                self._timed(req, tokens, now)
                return self.finish(
                    live, reason, now=now, tokens=tokens, logprobs=logprobs, stop_reason=stop_reason
                )
        self._timed(req, tokens, now)
        return live.output(tokens, logprobs)

    def _refusal(self, req: Request, token: int) -> str | None:
        """Why ``token`` cannot be appended to ``req`` (its request fails), or None."""
        if token == INVALID_TOKEN:
            # The sampler found no usable logit in the row (NaN, +inf, or nothing finite):
            # fail the request rather than emit an arbitrary token.
            logger.error("request %s: non-finite logits, failing it", req.request_id)
            return "the model produced non-finite logits"
        if req.matcher is not None and not req.matcher.accept_token(token):
            # The mask allowed only tokens the grammar accepts: this is a matcher fault.
            logger.error("request %s: the grammar refused sampled token %d", req.request_id, token)
            return "the output grammar refused the sampled token"
        return None

    def _timed(self, req: Request, tokens: list[int], now: float) -> None:
        """Count a step's ``tokens`` and its one inter-token gap (vLLM's: one per step that
        produced tokens, however many it produced)."""
        self.stats.generation_tokens_total += len(tokens)
        if req.first_token_time is None:
            req.first_token_time = now
        else:
            self.stats.inter_token_latency.observe(now - req.last_token_time)
        req.last_token_time = now

    def finish(
        self,
        live: LiveRequest,
        reason: str,
        *,
        now: float,
        tokens: Sequence[int] = (),
        logprobs: list[TokenLogprob] | None = None,
        stop_reason: str | int | None = None,
        error: str | None = None,
        pooled: list[float] | None = None,
    ) -> RequestOutput:
        """End the request for ``reason`` (its blocks are freed now); ``tokens`` and
        ``logprobs`` are this step's last ones, ``pooled`` a pooling request's answer; ``now``
        is ``time.monotonic()`` seconds."""
        req = live.request
        self.scheduler.finish(req, reason)
        self.live.pop(req.request_id, None)
        metrics = request_metrics(req, now)
        self.stats.observe_finished(metrics, reason, first_token=req.first_token_time is not None)
        return live.output(
            list(tokens),
            logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            metrics=metrics,
            error=error,
            pooled=pooled,
        )
