"""CUDA timing for the ``perf/`` microbenchmarks: CUDA events, cold-L2 rotation, CUDA graphs.

One measurement (:class:`CudaTimer`) times a list of *calls*, one per copy of the inputs:

1. **Warm-up.** Every call runs once (Triton compiles, allocator caches fill), then the device
   synchronises.
2. **Cold L2.** The calls are always run in rotation. :func:`cold_copies` says how many input
   copies a benchmark should build: enough that, between two uses of one copy, the others
   stream at least twice the L2 (H200: 60 MB) through it, so every call reads cold data. A
   working set of two L2s or more needs one copy.
3. **CUDA graph** (``graph=True``, where the engine would capture: decode attention, sampling).
   One graph holds one pass over every copy; a replay is one *unit*. Capture is tried once; if
   it fails the calls are timed eagerly and :attr:`CudaTimer.note` says why. Eagerly, a unit
   is one pass over the copies.
4. **Samples.** A sample is ``units_per_sample`` units between two CUDA events, sized to take
   about ``SAMPLE_TARGET_US`` of GPU time. Before the start event the stream gets a
   ``torch.cuda._sleep`` long enough for the host to enqueue the whole sample, so the events
   see back-to-back GPU work and not the host's launch latency (calls that synchronise with the
   host, ``host_syncs=True``, skip this: their host time is part of their cost).
5. **Result.** The per-call time of a sample is its event time over the calls it ran; the
   measurement reports the median (and min / p90) over its samples (:class:`Timing`).

:func:`run_with_benchmark` lets pytest-benchmark drive the samples with the per-call event time
as its clock, so its statistics and JSON hold CUDA-event times, not host wall time.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

DEFAULT_L2_BYTES = 60 * 2**20  # H200; used when the device does not report its L2 size
MAX_COPIES = 256
SAMPLE_TARGET_US = 500.0
MAX_UNITS_PER_SAMPLE = 10_000
MAX_PRELOAD_US = 50_000.0
# GPU time one measurement aims to spend in samples (override: PAGED_SERVE_PERF_BUDGET_S).
MEASURE_BUDGET_S = float(os.environ.get("PAGED_SERVE_PERF_BUDGET_S", "0.15"))
MIN_ROUNDS = 5
MAX_ROUNDS = 40


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-call GPU time of one measurement, in microseconds."""

    median_us: float
    min_us: float
    p90_us: float
    rounds: int
    calls_per_round: int
    copies: int
    graph: bool
    note: str = ""

    def info(self, prefix: str) -> dict[str, Any]:
        """The fields as ``benchmark.extra_info`` entries named ``{prefix}_{field}``."""
        return {f"{prefix}_{k}": v for k, v in asdict(self).items() if v != ""}


def l2_cache_bytes(device: torch.device | int | None = None) -> int:
    """The device's L2 size in bytes (``DEFAULT_L2_BYTES`` if torch does not report it)."""
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def cold_copies(working_set_bytes: int, *, l2_bytes: int, max_copies: int = MAX_COPIES) -> int:
    """How many input copies to rotate through so that every call reads cold data.

    ``working_set_bytes``: bytes one call touches. Between two uses of a copy the other copies
    move at least ``2 * l2_bytes`` through the cache (capped at ``max_copies``).
    """
    if working_set_bytes <= 0:
        raise ValueError(f"working_set_bytes must be > 0, got {working_set_bytes}")
    if working_set_bytes >= 2 * l2_bytes:
        return 1
    return max(2, min(max_copies, math.ceil(2 * l2_bytes / working_set_bytes) + 1))


def free_device_bytes() -> int:
    """Free memory on the current CUDA device, in bytes."""
    return int(torch.cuda.mem_get_info()[0])


def _event_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


@functools.cache
def _sleep_cycles_per_us() -> float | None:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond (None if torch lacks it)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    cycles = 2_000_000
    start, end = _event_pair()
    torch.cuda.synchronize()
    start.record()
    sleep(cycles)
    end.record()
    end.synchronize()
    elapsed_us = start.elapsed_time(end) * 1e3
    return cycles / elapsed_us if elapsed_us > 0 else None


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class CudaTimer:
    """Times ``calls`` (one per input copy, always run in rotation) with CUDA events.

    ``graph``: capture one pass over the calls in a CUDA graph and time replays.
    ``host_syncs``: the calls synchronise with the host (e.g. ``.tolist()``), so the stream is
    not pre-filled before a sample. See the module docstring for the procedure.
    """

    def __init__(
        self,
        calls: Sequence[Callable[[], object]],
        *,
        graph: bool,
        host_syncs: bool = False,
        sample_target_us: float = SAMPLE_TARGET_US,
    ) -> None:
        if not calls:
            raise ValueError("CudaTimer needs at least one call")
        self._calls = list(calls)
        self.copies = len(self._calls)
        self.graph = False
        self.note = ""
        self.samples_us: list[float] = []
        self._clock_s = 0.0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._unit: Callable[[], None] = self._eager_pass

        for call in self._calls:  # warm-up: compile, fill allocator caches
            call()
        torch.cuda.synchronize()
        if graph:
            self._capture()

        self._estimate()  # the first unit after capture may still be cold
        unit_us, issue_us = self._estimate()
        self.unit_us = unit_us
        self.units_per_sample = max(
            1, min(MAX_UNITS_PER_SAMPLE, math.ceil(sample_target_us / max(unit_us, 1e-3)))
        )
        cycles_per_us = None if host_syncs else _sleep_cycles_per_us()
        self._preload_cycles = 0
        if cycles_per_us:
            preload_us = min(MAX_PRELOAD_US, 20.0 + 1.5 * issue_us * self.units_per_sample)
            self._preload_cycles = int(preload_us * cycles_per_us)

    @property
    def calls_per_sample(self) -> int:
        return self.units_per_sample * self.copies

    def _eager_pass(self) -> None:
        for call in self._calls:
            call()

    def _capture(self) -> None:
        # torch's recipe: warm up on a side stream, then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager_pass()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._eager_pass()
        except RuntimeError as exc:  # not capturable (e.g. a host sync): time eagerly instead
            torch.cuda.synchronize()
            reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
            self.note = f"graph capture failed ({type(exc).__name__}: {reason}); timed eagerly"
            return
        self._graph = graph
        self._unit = graph.replay
        self.graph = True

    def _estimate(self) -> tuple[float, float]:
        """(GPU microseconds of one unit, host microseconds to issue it)."""
        start, end = _event_pair()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        self._unit()
        end.record()
        issue_us = (time.perf_counter() - t0) * 1e6
        end.synchronize()
        return start.elapsed_time(end) * 1e3, issue_us

    def sample(self) -> float:
        """Run one sample; returns (and records) its per-call time in microseconds."""
        start, end = _event_pair()
        if self._preload_cycles:
            torch.cuda._sleep(self._preload_cycles)
        start.record()
        for _ in range(self.units_per_sample):
            self._unit()
        end.record()
        end.synchronize()
        per_call_us = start.elapsed_time(end) * 1e3 / self.calls_per_sample
        self.samples_us.append(per_call_us)
        self._clock_s += per_call_us * 1e-6
        return per_call_us

    def clock(self) -> float:
        """Seconds of per-call GPU time sampled so far: a clock for pytest-benchmark."""
        return self._clock_s

    def suggested_rounds(self, budget_s: float = MEASURE_BUDGET_S) -> int:
        """Samples that fit ``budget_s`` of GPU time, within [MIN_ROUNDS, MAX_ROUNDS]."""
        sample_s = self.unit_us * self.units_per_sample * 1e-6
        return max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget_s / max(sample_s, 1e-9))))

    def run(self, rounds: int | None = None) -> Timing:
        """Take ``rounds`` samples (default :meth:`suggested_rounds`) and summarise."""
        for _ in range(rounds if rounds is not None else self.suggested_rounds()):
            self.sample()
        return self.result()

    def result(self) -> Timing:
        if not self.samples_us:
            raise RuntimeError("no samples taken")
        return Timing(
            median_us=statistics.median(self.samples_us),
            min_us=min(self.samples_us),
            p90_us=_percentile(self.samples_us, 0.9),
            rounds=len(self.samples_us),
            calls_per_round=self.calls_per_sample,
            copies=self.copies,
            graph=self.graph,
            note=self.note,
        )

    def release(self) -> None:
        """Drop the graph and the calls (and the tensors they hold)."""
        self._graph = None
        self._unit = self._eager_pass
        self._calls = []


def measure(
    calls: Sequence[Callable[[], object]], *, graph: bool, host_syncs: bool = False
) -> Timing:
    """Time ``calls`` with a :class:`CudaTimer` and release it."""
    timer = CudaTimer(calls, graph=graph, host_syncs=host_syncs)
    try:
        return timer.run()
    finally:
        timer.release()


def run_with_benchmark(benchmark: Any, timer: CudaTimer) -> Timing:
    """Let pytest-benchmark take the samples, with the per-call CUDA-event time as its clock.

    pytest-benchmark times each round as ``timer() - timer()`` around the target; handing it
    :meth:`CudaTimer.clock` makes every round's duration the sample's per-call GPU time. (If
    the fixture has no ``_timer`` attribute -- another pytest-benchmark version or the
    stand-in of ``perf/conftest.py`` -- its own statistics are host wall time per sample.)
    With ``--benchmark-disable`` it runs one round; the timer tops up to ``MIN_ROUNDS``.
    """
    if hasattr(benchmark, "_timer"):
        benchmark._timer = timer.clock
    benchmark.pedantic(timer.sample, rounds=timer.suggested_rounds(), iterations=1)
    while len(timer.samples_us) < MIN_ROUNDS:
        timer.sample()
    return timer.result()


def device_copy_bandwidth_gbps(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written, over time)."""
    nbytes = min(nbytes, free_device_bytes() // 4)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    dst = torch.empty_like(src)
    timing = measure([lambda: dst.copy_(src)], graph=False)
    return 2 * nbytes / (timing.median_us * 1e-6) / 1e9
