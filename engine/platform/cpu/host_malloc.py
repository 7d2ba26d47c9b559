"""Keep freed host memory for reuse: a CPU step's large temporaries stop faulting in fresh pages.

Every CPU step allocates its activations anew (torch's CPU allocator caches nothing): a
1,560-token prefill of SmolLM2-135M in fp32 makes per layer a 6 MB q/k/v output, a 19 MB
gate/up output, two 9.6 MB halves and more. glibc's malloc serves blocks above its mmap
threshold with fresh ``mmap`` pages and gives them back on free, and returns free memory at the
top of a heap above its trim threshold; either way the next step faults the pages in again, one
4 KiB page at a time, each zeroed by the kernel. That prefill step took 236,000-315,000 minor
page faults and 2.31-2.70 s (median 2.55); with the settings below, 6,800-25,500 faults and
2.11-2.46 s (median 2.16). Through the server, whose engine thread allocates from its own malloc
arena, the decode-heavy mix ran at 122-139 output tok/s against 92-114
(docs/measurements/cpu-kernels.md). Decode steps, whose temporaries are small, fault about as rarely
either way once warm.

``keep_freed_memory`` raises the mmap threshold to glibc's largest (32 MiB on 64-bit: bigger
blocks, like the KV cache, are still mapped apart) and the trim threshold to the largest value
``mallopt`` takes, so freed blocks stay in malloc's heaps for the next step. The cost: the
process keeps the peak of its small-block use resident, as a caching allocator does (torch's own
on CUDA, or TCMalloc, which vLLM's CPU guide recommends preloading).
It changes malloc for the whole process (calling it again changes nothing more); a no-op (False)
where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the largest one, "never trim"


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks of up to 32 MiB for reuse (see the module);
    True when both settings took, False elsewhere."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    if not done:
        logger.info("glibc's malloc refused the reuse settings: steps may fault in fresh pages")
    return done
