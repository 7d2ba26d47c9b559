"""glibc's malloc keeps freed blocks for reuse once a CPU engine is built
(engine/platform/cpu/host_malloc.py).

The settings are process-wide and cannot be read back, so the effect is measured in fresh
processes: the same loop of step-sized temporaries faults in far fewer fresh pages with them.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

import paged_serve.engine.platform.cpu.host_malloc as host_malloc
from paged_serve.engine.llm import LLM
from paged_serve.engine.platform.cpu.host_malloc import keep_freed_memory
from tests.conftest import loaded, tiny_model

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Temporaries shaped like one fp32 prefill layer of SmolLM2-135M over 1,560 tokens (6-19 MB),
# made and freed 20 times; prints the minor page faults of the loop.
#
# "default" sets glibc's default thresholds (128 KiB) explicitly: left unset, glibc moves its
# mmap threshold up as mmapped blocks are freed, by an amount that depends on what ran before,
# and the default loop's faults varied from 10,814 to 186,584 between identical runs.
LOOP = """
import ctypes, resource, sys, torch
from paged_serve.engine.platform.cpu.host_malloc import (
    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:
    libc = ctypes.CDLL(None)
    assert libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
    assert libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024) == 1
def layer():
    qkv, gate_up, out = torch.ones(1560, 960), torch.ones(1560, 3072), torch.ones(1560, 576)
    act = gate_up[:, :1536] * gate_up[:, 1536:]
    return float(qkv.sum() + act.sum() + out.sum())
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _loop_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", LOOP, mode],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[4],  # the repository root: engine/ importable
    )
    return int(done.stdout.split()[-1])


@glibc_only
def test_keep_freed_memory_takes_on_glibc_and_may_be_repeated():
    assert keep_freed_memory()
    assert keep_freed_memory()


@glibc_only
def test_kept_memory_spares_the_page_faults_of_repeated_large_temporaries():
    default, kept = _loop_faults("default"), _loop_faults("keep")
    # 20 loops of about 45 MB: glibc's defaults fault in thousands of fresh 4 KiB pages.
    assert default > 2000, default
    assert kept < default / 3, (kept, default)


def test_a_cpu_engine_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []
    monkeypatch.setattr(host_malloc, "keep_freed_memory", lambda: calls.append(True) or True)
    LLM(loaded=loaded(tiny_model("llama")), kv_cache_memory=1 << 20, device="cpu")
    assert calls == [True]
