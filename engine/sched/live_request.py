"""A live request's output side: its detokenizer, its stop conditions and its outputs."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from paged_serve.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from paged_serve.engine.sched.detokenizer import IncrementalDetokenizer
from paged_serve.engine.sched.request import Request


@dataclass(slots=True)
class LiveRequest:
    """A request the engine tracks from ``add_request`` until its final output."""

    request: Request
    detokenizer: IncrementalDetokenizer
    prompt_logprobs_sent: bool = False

    @classmethod
    def start(cls, request: Request, tokenizer: object | None) -> LiveRequest:
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=request.params.skip_special_tokens,
            stop=request.params.stop,
        )
        return cls(request, detokenizer)

    def forget_text(self) -> None:
        """Stop detokenizing (after the detokenizer itself failed): the rest is ids only."""
        self.detokenizer = IncrementalDetokenizer(None, [])

    def stop_reason(
        self, token: int, *, eos_token_ids: Set[int], max_model_len: int
    ) -> tuple[str | None, str | int | None]:
        """Detokenize the newly appended ``token``; (finish_reason, stop_reason) if it ends the
        request, else (None, None)."""
        req = self.request
        params = req.params
        if token in params.stop_token_ids:
            return "stop", token
        if token in eos_token_ids and not params.ignore_eos:
            return "stop", None
        if req.matcher is not None and req.matcher.is_terminated():
            return "stop", None  # the grammar is complete and took its stop token
        if self.detokenizer.add_token(token):
            return "stop", self.detokenizer.stopped_on
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= max_model_len:
            return "length", None
        return None, None

    def output(
        self,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        *,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        metrics: RequestMetrics | None = None,
        error: str | None = None,
        pooled: list[float] | None = None,
    ) -> RequestOutput:
        """This step's output; a ``finish_reason`` makes it the last one (text flushed)."""
        req = self.request
        finished = finish_reason is not None
        if finished:
            self.detokenizer.flush()
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = list(req.prompt_logprobs), True
        return RequestOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=tokens,
            new_text=self.detokenizer.take_delta(finished=finished),
            new_logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            metrics=metrics,
            error=error,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )


def request_metrics(req: Request, now: float) -> RequestMetrics:
    """A finished request's timings (``now`` and the request's times: ``time.monotonic()``)."""
    n_out = len(req.output_token_ids)
    first = req.first_token_time
    return RequestMetrics(
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=n_out,
        num_cached_tokens=req.num_cached_tokens,
        ttft=(first or now) - req.arrival_time,
        tpot=(now - first) / (n_out - 1) if n_out > 1 and first else 0.0,
        e2e_latency=now - req.arrival_time,
        num_preemptions=req.num_preemptions,
        queue_time=(
            None
            if req.first_scheduled_time is None
            else req.first_scheduled_time - req.arrival_time
        ),
    )
