"""What the engine hands back: per-step deltas and per-request results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's logprob and the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings in seconds. TPOT is the mean gap between output tokens after the first;
    queue time runs from arrival to the first admission into the running batch (None for a
    request that finished before it was ever admitted)."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ttft: float
    tpot: float
    e2e_latency: float
    num_preemptions: int
    queue_time: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's news for one request: the new tokens and the text safe to emit.

    ``finished`` is set on the last output of a request, with ``finish_reason`` in
    ``stop`` / ``length`` / ``abort`` / ``error`` and its ``metrics``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None
    index: int = 0  # which of the request's n samples this is
    error: str | None = None  # set with finish_reason "error": processing this request failed
    # On a request's first output when it asked for prompt_logprobs: one entry per prompt
    # token, None for the first (it has no context).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's answer, on its one (finished) output: an embedding or label scores.
    pooled: list[float] | None = None


@dataclass(slots=True)
class CompletionResult:
    """A finished request, as ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.metrics = out.metrics
