"""Freeing a thread's OpenMP workers: the threads really go, torch still computes afterwards,
and the async engine frees its builder's pool before its engine thread starts."""

from __future__ import annotations

import os
import threading

import torch

import paged_serve.engine.async_engine as async_engine
import paged_serve.engine.platform.cpu.openmp_pool as openmp_pool
from paged_serve.engine import EngineConfig
from paged_serve.engine.platform.cpu.openmp_pool import release_openmp_pool
from tests.conftest import loaded, tiny_model


def _os_threads() -> set[str]:
    """The process's OS thread ids (ids, not a count: other tests' threads may come and go)."""
    return set(os.listdir("/proc/self/task"))


def test_release_frees_the_calling_threads_workers(two_threads: None) -> None:
    """A fresh thread's parallel region builds its own pool; releasing it ends those workers,
    and the next region on that thread still gives the right answer."""
    x = torch.randn(2048, 2048)
    want = x.sum(dim=1)
    seen: dict[str, object] = {}

    def work() -> None:
        torch.set_num_threads(2)
        seen["before"] = _os_threads()
        x.sum(dim=1)  # a parallel region: this thread now owns a pool
        seen["with_pool"] = _os_threads()
        seen["released"] = release_openmp_pool()
        seen["after"] = _os_threads()
        seen["again"] = x.sum(dim=1)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] is True  # torch's CPU wheel ships libgomp, which supports pausing
    workers = seen["with_pool"] - seen["before"]  # the threads the region started
    assert workers, "the parallel region started no worker thread"
    assert workers - seen["after"], "releasing the pool ended none of its workers"
    assert torch.equal(seen["again"], want)


def test_async_engine_releases_the_pool_before_its_thread_starts(monkeypatch) -> None:
    calls: list[bool] = []

    def record() -> bool:
        calls.append(threading.current_thread() is threading.main_thread())
        return True

    monkeypatch.setattr(openmp_pool, "release_openmp_pool", record)
    eng = async_engine.AsyncEngine(
        EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(tiny_model("llama"))
    )
    try:
        assert calls == [True]  # once, on the thread that built the engine
    finally:
        eng.shutdown()
