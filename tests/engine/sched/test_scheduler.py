"""Scheduler: FCFS admission under budget, seats and blocks; chunking; preemption order."""

from __future__ import annotations

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.request import Request, RequestStatus
from paged_serve.engine.sched.scheduler import Scheduler


def make(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), seed=0)


def run_step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule, then pretend the model ran: advance progress and append a token to samplers."""
    batch = scheduler.schedule()
    for s in batch.requests:
        s.request.num_computed_tokens = s.end
        if s.samples:
            s.request.output_token_ids.append(7)
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in batch.requests]


def test_fcfs_admission_and_budget_chunking():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=10)
    for rid, n in [("a", 6), ("b", 7), ("c", 3)]:
        sched.add(make(rid, n))
    assert run_step(sched) == [("a", 0, 6), ("b", 0, 4)]  # b is chunked by the budget
    assert run_step(sched) == [("a", 6, 1), ("b", 4, 3), ("c", 0, 3)]
    assert run_step(sched) == [("a", 7, 1), ("b", 7, 1), ("c", 3, 1)]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        sched.add(make(rid, 4))
    assert [r[0] for r in run_step(sched)] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_blocks_limit_admission():
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make("a", 5))
    sched.add(make("b", 4))
    assert [r[0] for r in run_step(sched)] == ["a"]


def test_preempts_the_most_recent_request_and_requeues_it_first():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make("a", 8))
    sched.add(make("b", 8))
    sched.add(make("late", 2))
    run_step(sched)  # a and b take all 4 blocks; "late" waits
    assert bm.num_free_blocks == 0
    steps = run_step(sched)  # a needs a 3rd block: b (most recent) is preempted
    assert steps == [("a", 8, 1)]
    b = sched.waiting[0]
    assert b.request_id == "b" and b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert [r.request_id for r in sched.waiting] == ["b", "late"]
    assert sched.num_preemptions == 1
    bm.check_integrity()


def test_finish_frees_blocks_wherever_the_request_is():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make("a", 5), make("b", 5)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_work
    assert a.finish_reason == "abort" and a.is_finished
    bm.check_integrity()
    assert bm.usage().used_blocks == 0


def test_a_preempted_request_resumes_from_its_cached_blocks():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make("a", 8)
    b = Request("b", list(range(11, 19)), SamplingParams(max_tokens=100), seed=0)
    sched.add(a)
    sched.add(b)
    for _ in range(2):  # a grows past its 2 blocks: b is preempted and its blocks freed
        for s in sched.schedule().requests:
            s.request.num_computed_tokens = s.end
            bm.commit(s.request.request_id, s.request.all_token_ids, s.end)
            if s.samples:
                s.request.output_token_ids.append(7)
    # a took b's leaf block (evicted first); b's first block stays cached.
    assert b.num_preemptions == 1 and bm.usage().cached_blocks == 1
    sched.finish(a, "stop")
    batch = sched.schedule()
    [resumed] = [s for s in batch.requests if s.request is b]
    # b's prompt+output is 9 tokens: its cached first block is reused, the rest recomputed.
    assert (resumed.start, resumed.num_new_tokens) == (4, 5)
    assert sched.prefix_hit_tokens == 4
    bm.check_integrity()
