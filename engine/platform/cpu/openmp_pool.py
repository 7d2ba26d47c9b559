"""Hand the CPU's OpenMP workers to the engine thread: free the idle pool of the thread that
loaded the model.

torch's CPU kernels (ATen's ``parallel_for``, oneDNN, MKL) run their parallel regions on OpenMP.
libgomp, torch's OpenMP runtime on Linux, keeps one pool of worker threads per thread that has
started a parallel region, and counts the workers of every pool. When that count exceeds the
CPUs, it stops spinning between parallel regions: each region then waits for its workers to be
woken from a futex, hundreds of times per decode step.

The server loads and prepares the model on its main thread (one pool) and steps it on the
engine thread (a second pool): on a 2-core machine that is 3 managed threads for 2 CPUs, so
every step ran throttled. Measured, SmolLM2-135M bf16 decoding one stream: 33.3 ms per step on
the main thread, 52.0 ms on the engine thread, 33.3 ms on the engine thread once the main
thread's pool is freed (docs/measurements/cpu-kernels.md). ``omp_pause_resource_all`` (OpenMP 5.0)
frees the calling thread's pool; a later parallel region on that thread would build a new one, so
the thread that loaded the model should leave CPU tensor work to the engine thread afterwards.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the threads, not only park them


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (torch's libgomp, or an Intel/LLVM one), or
    None where none is found (or there is no /proc to look in)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's idle OpenMP worker threads; True when the runtime did.

    Call it on the thread that loaded the model, before another thread starts stepping it.
    A no-op (False) without an OpenMP runtime that supports pausing.
    """
    runtime = _openmp_runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None) if runtime is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    freed = pause(OMP_PAUSE_HARD) == 0
    if not freed:
        logger.info("the OpenMP runtime did not free the loading thread's workers")
    return freed
