"""The dashboard's engine state: the pool map agrees with usage() and the tables, copy-on-write
is recorded, and the watch takes states only when wanted and never faster than its interval."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from paged_serve.engine.observe import engine_state
from paged_serve.engine.observe.engine_state import StateWatch, pool_integrity, take_state
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.block_manager import RECENT_COPIES, BlockManager
from paged_serve.engine.sched.request import Request, RequestStatus
from paged_serve.engine.sched.scheduler import Scheduler

INF = float("inf")  # no bound on the time spent taking states


def check_map_agrees(bm: BlockManager) -> str:
    """The pool map's counts against usage() and the block tables; returns the map."""
    pool = bm.pool_map()
    usage = bm.usage()
    counts = Counter(pool)
    assert len(pool) == bm.num_blocks
    assert counts["u"] + counts["s"] == usage.used_blocks
    assert counts["c"] == usage.cached_blocks
    assert counts["."] + counts["c"] == usage.free_blocks
    holders = Counter(b for rid in list(bm._tables) for b in bm.block_table(rid))
    assert {b for b, n in holders.items() if n > 1} == {i for i, ch in enumerate(pool) if ch == "s"}
    assert {b for b, n in holders.items() if n == 1} == {
        i for i, ch in enumerate(pool) if ch == "u"
    }
    bm.check_integrity()
    return pool


def test_pool_map_marks_free_cached_used_and_shared_blocks():
    bm = BlockManager(12, 4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks and a partial one
    bm.allocate("a", len(prompt))
    bm.commit("a", prompt, len(prompt))
    assert check_map_agrees(bm) == "uuu" + "." * 9
    bm.fork("a", "a.1")
    assert check_map_agrees(bm) == "sss" + "." * 9
    # The fork writes into the shared partial block: it gets a private copy first.
    assert bm.append_slots("a.1", 11) == [(2, 3)]
    assert check_map_agrees(bm) == "ssuu" + "." * 8
    bm.free("a")
    bm.free("a.1")
    # The two full blocks stay in the prefix cache; the partial ones are plain free blocks.
    assert check_map_agrees(bm) == "cc" + "." * 10
    hits = bm.cached_prefix(prompt)
    bm.allocate("b", len(prompt), hits)
    assert check_map_agrees(bm)[:2] == "uu"


def test_copy_on_write_is_counted_and_the_recent_pairs_kept():
    bm = BlockManager(64, 4)
    bm.allocate("p", 2)
    pairs = []
    for i in range(RECENT_COPIES + 3):
        bm.fork("p", f"c{i}")
        pairs += bm.append_slots(f"c{i}", 3)
    assert bm.copy_on_write_total == len(pairs) == RECENT_COPIES + 3
    assert list(bm.recent_copies) == pairs[-RECENT_COPIES:]
    check_map_agrees(bm)


def _engine(bm: BlockManager) -> SimpleNamespace:
    """What take_state reads of an LLMEngine: the block manager, the scheduler, the steps, the
    KV cache's dtype."""
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    runner = SimpleNamespace(kv_cache=SimpleNamespace(tensor=torch.empty(0, dtype=torch.int8)))
    return SimpleNamespace(block_manager=bm, scheduler=scheduler, num_steps=0, runner=runner)


def _request(rid: str, prompt_len: int) -> Request:
    params = SamplingParams(max_tokens=5, temperature=0)
    return Request(rid, list(range(1, prompt_len + 1)), params, seed=0)


def test_take_state_lists_requests_with_their_tables():
    bm = BlockManager(8, 4)
    engine = _engine(bm)
    for rid, n in (("r0", 9), ("r1", 3), ("r2", 40)):
        engine.scheduler.add(_request(rid, n))
    batch = engine.scheduler.schedule()
    assert [s.request.request_id for s in batch.requests] == ["r0", "r1"]  # r2: too few blocks
    state = take_state(engine, gauges="g")
    assert state.gauges == "g"
    assert [r.id for r in state.running] == ["r0", "r1"]
    assert [r.id for r in state.waiting] == ["r2"]
    r0 = state.running[0]
    assert r0.status == "running" and r0.prompt_tokens == 9 and r0.max_tokens == 5
    assert r0.blocks == bm.block_table("r0")
    assert state.waiting[0].blocks == [] and state.waiting[0].status == "waiting"
    kv = state.kv
    assert kv.map == bm.pool_map() and kv.usage == bm.usage()
    assert kv.usage.used_blocks == len({b for r in state.running for b in r.blocks})
    assert kv.num_blocks == 8 and kv.block_size == 4 and kv.shared_blocks == 0
    assert engine.scheduler.running[0].status is RequestStatus.RUNNING


def test_a_pooling_request_is_listed_with_its_task_and_no_output_budget():
    """It generates nothing: max_tokens 0 (not its carrier's 1) and ``pooling`` names the task;
    a generation request's ``pooling`` is None."""
    engine = _engine(BlockManager(8, 4))
    pooled = _request("p", 6)
    pooled.pooling = PoolingParams(task="embed")
    engine.scheduler.add(pooled)
    engine.scheduler.add(_request("g", 3))
    engine.scheduler.schedule()
    by_id = {r.id: r for r in take_state(engine, gauges="g").running}
    assert (by_id["p"].pooling, by_id["p"].max_tokens, by_id["p"].output_tokens) == ("embed", 0, 0)
    assert (by_id["g"].pooling, by_id["g"].max_tokens) == (None, 5)


def test_the_watch_takes_nothing_unless_wanted():
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=0.0, max_busy_fraction=INF)
    for gauges in range(5):
        watch.after_step(engine, gauges)
    assert watch.num_taken == 0 and watch.latest is None
    watch.want()
    watch.after_step(engine, "step-1")
    assert watch.num_taken == 1 and watch.latest.gauges == "step-1"


def test_the_watch_does_not_retake_a_current_state():
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=0.0, max_busy_fraction=INF)
    watch.want()
    gauges = object()
    first = watch.take_if_due(engine, gauges)
    assert watch.take_if_due(engine, gauges) is first  # the same engine moment
    assert watch.take_if_due(engine, object()) is not first
    assert watch.num_taken == 2


def test_the_watch_respects_its_interval():
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=3600.0)
    watch.want()
    first = watch.take_if_due(engine, "a")
    for gauges in "bcd":
        watch.after_step(engine, gauges)
        assert watch.take_if_due(engine, gauges) is first
    assert watch.num_taken == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_take_is_taken_less_often(monkeypatch):
    """A take of 0.5 s at a 2% time budget is next due 25 s later, not after 0.2 s."""
    clock = FakeClock()

    def slow_take(engine, gauges):
        clock.now += 0.5
        return take_state(engine, gauges)

    monkeypatch.setattr(engine_state, "take_state", slow_take)
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=0.2, max_busy_fraction=0.02, clock=clock)
    watch.want()
    first = watch.take_if_due(engine, "a")
    for t in (1.0, 10.0, 24.0):  # seconds after the take began
        clock.now = 100.0 + t
        watch.want()
        watch.after_step(engine, f"at {t}")
        assert watch.latest is first
    clock.now = 125.0
    watch.after_step(engine, "due")
    assert watch.latest.gauges == "due" and watch.num_taken == 2


def test_the_watch_window_lapses():
    clock = FakeClock()
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=0.0, window_s=2.0, max_busy_fraction=INF, clock=clock)
    watch.want()
    clock.now += 1.9
    watch.after_step(engine, "watched")
    clock.now += 0.2  # 2.1 s after the last request
    watch.after_step(engine, "unwatched")
    assert watch.num_taken == 1 and watch.latest.gauges == "watched"


def test_a_failing_take_never_reaches_the_engine_loop(monkeypatch, caplog):
    engine = _engine(BlockManager(4, 4))
    watch = StateWatch(min_interval_s=0.0, max_busy_fraction=INF)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr("paged_serve.engine.observe.engine_state.take_state", broken)
    watch.want()
    watch.after_step(engine, "a")  # logged, not raised
    assert watch.broken and "taking the engine state failed" in caplog.text
    watch.want()
    watch.after_step(engine, "b")
    assert watch.latest is None


@pytest.mark.parametrize("n", [1, 3])
def test_waiting_list_is_capped(n, monkeypatch):
    monkeypatch.setattr("paged_serve.engine.observe.engine_state.MAX_WAITING_LISTED", n)
    engine = _engine(BlockManager(4, 4))
    for i in range(5):
        engine.scheduler.add(_request(f"w{i}", 3))
    state = take_state(engine, gauges=None)
    assert [r.id for r in state.waiting] == [f"w{i}" for i in range(n)]


def test_pool_integrity_names_the_first_disagreement():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    bm.allocate("a", 6)
    assert pool_integrity(bm) == "ok"
    bm._blocks[bm.block_table("a")[0]].ref_count = 2  # a leak: one holder, two references
    assert pool_integrity(bm).startswith(f"block {bm.block_table('a')[0]}: ref_count 2")
