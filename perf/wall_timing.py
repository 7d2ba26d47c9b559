"""Wall-clock medians for host-side microbenchmarks (no device sync, unlike
perf/kernels/cuda_timing.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_wall_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, in seconds (no warm-up call)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
