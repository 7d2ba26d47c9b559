"""Engine counters and latency histograms, read by the server's /metrics endpoint."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from engine.outputs import RequestMetrics

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram of seconds (Prometheus semantics)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound label, cumulative count) pairs, ``+Inf`` last."""
        out, running = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


@dataclass(slots=True)
class EngineStats:
    """Totals since start. Updated by the engine thread; ``lock`` guards reads elsewhere."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_finished(self, metrics: RequestMetrics, *, first_token: bool) -> None:
        """Count a finished request; its TTFT only if it produced a token, its TPOT only if it
        produced two or more."""
        with self.lock:
            self.requests_finished_total += 1
            if first_token:
                self.ttft.observe(metrics.ttft)
            if metrics.num_output_tokens > 1:
                self.tpot.observe(metrics.tpot)
