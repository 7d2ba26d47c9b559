"""State snapshots (engine/sched/state_snapshots.py) and the block manager's use of them: where
chunks end, which hits a model with state slots may resume from, the copies that save and
restore a state, eviction with the block's key and by least recent use, and the state cache
running the copies in order."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine.kv.state_cache import LinearStateShape, StateCache, copy_waves
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.state_slots import StateSlots
from paged_serve.engine.sched.state_snapshots import StateSnapshots

BLOCK = 4


def _manager(rows: int = 2, interval: int = 2 * BLOCK, num_blocks: int = 16) -> BlockManager:
    slots = StateSlots(3)
    snapshots = StateSnapshots(first_row=4, count=rows, interval_tokens=interval)
    return BlockManager(num_blocks, BLOCK, True, state_slots=slots, state_snapshots=snapshots)


def test_chunks_end_at_the_last_boundary_they_cross() -> None:
    snapshots = StateSnapshots(first_row=0, count=1, interval_tokens=16)
    assert snapshots.chunk_end(0, 40) == 32  # crosses 16 and 32: ends at 32
    assert snapshots.chunk_end(32, 40) == 40  # crosses none
    assert snapshots.chunk_end(15, 17) == 16
    assert snapshots.chunk_end(16, 17) == 17  # a decode row after a boundary
    assert snapshots.chunk_end(31, 32) == 32  # a decode row onto one
    assert not snapshots.at_boundary(0) and snapshots.at_boundary(48)


def test_rows_are_reused_least_recently_used_first() -> None:
    snapshots = StateSnapshots(first_row=10, count=2, interval_tokens=4)
    first, second = snapshots.save(1), snapshots.save(2)
    assert {first, second} == {10, 11}
    assert snapshots.restore(1) == first  # block 1 is now the most recent
    assert snapshots.save(3) == second  # block 2's row, the least recently used
    assert not snapshots.has(2) and snapshots.has(1) and snapshots.has(3)
    assert snapshots.resumable([1, 2, 3, 5]) == 3 and snapshots.resumable([2, 5]) == 0
    snapshots.forget(3)
    assert snapshots.num_used == 1
    with pytest.raises(RuntimeError, match="already has a snapshot"):
        snapshots.save(1)


def test_a_boundary_saves_the_slot_and_a_hit_restores_it() -> None:
    bm = _manager()
    tokens = list(range(100, 120))  # five blocks
    bm.allocate("a", 12)  # a 12-token chunk: boundary 8 is inside it, so nothing to keep
    bm.commit("a", tokens, 12)
    assert bm.snapshots.num_used == 0
    bm.append_slots("a", 16)
    bm.commit("a", tokens, 16)  # 16 = two intervals: the state after block 3 is kept
    slot = bm.state_slots.slot("a")
    [(src, row)] = bm.state_slots.take_copies()
    assert src == slot and row in (4, 5)
    bm.free("a")
    bm.check_integrity()
    # The whole prefix is cached, but only the first four blocks end in a snapshot.
    hits = bm.cached_prefix(tokens)
    assert len(hits) == 4
    bm.allocate("b", 20, hits)
    assert bm.state_slots.take_copies() == [(row, bm.state_slots.slot("b"))]
    assert bm.snapshots.restores_total == 1
    bm.free("b")
    bm.check_integrity()


def test_a_hit_stops_at_the_last_snapshot_and_none_without_one() -> None:
    bm = _manager(interval=4 * BLOCK)
    tokens = list(range(40))
    bm.allocate("a", 8)
    bm.commit("a", tokens, 8)  # 8 is no boundary of 16
    bm.free("a")
    assert bm.cached_prefix(tokens) == []  # two cached blocks, no state to resume from
    plain = BlockManager(16, BLOCK, True, state_slots=StateSlots(2))  # snapshots off
    plain.allocate("a", 16)
    plain.commit("a", tokens, 16)
    plain.free("a")
    assert plain.cached_prefix(tokens) == []


def test_a_snapshot_goes_with_its_blocks_key() -> None:
    bm = _manager(num_blocks=4)
    tokens = list(range(16))
    bm.allocate("a", 8)
    bm.commit("a", tokens, 8)
    bm.free("a")
    assert bm.snapshots.num_used == 1
    bm.allocate("b", 16)  # takes every block, evicting a's keys
    assert bm.snapshots.num_used == 0
    bm.check_integrity()
    bm.free("b")
    bm.allocate("c", 8)
    bm.commit("c", [7] * 8, 8)
    bm.free("c")
    assert bm.evict_cached() > 0 and bm.snapshots.num_used == 0  # /flush_cache drops them
    bm.check_integrity()


def test_copies_split_where_a_pair_reads_what_an_earlier_one_wrote() -> None:
    assert copy_waves([(0, 5), (1, 6)]) == [[(0, 5), (1, 6)]]
    assert copy_waves([(0, 5), (5, 1)]) == [[(0, 5)], [(5, 1)]]  # save, then restore
    assert copy_waves([(2, 5), (3, 5)]) == [[(2, 5)], [(3, 5)]]  # the same row twice
    assert copy_waves([]) == []


def test_the_state_cache_runs_a_save_and_a_restore_of_one_row_in_order() -> None:
    shape = LinearStateShape(layer_ids=(0, 2), conv_width=3, conv_channels=4, recurrent=(2, 3, 5))
    cache = StateCache(shape, num_slots=2, dtype=torch.float32, device="cpu", num_snapshots=2)
    assert cache.conv.shape == (2, 5, 2, 4) and cache.first_snapshot_row == 3
    cache.conv[:, 0] = 1.0
    cache.recurrent[:, 0] = 2.0
    cache.copy_slots([(0, 3), (3, 1)])  # slot 0 saved into row 3, row 3 restored into slot 1
    assert (cache.conv[:, 1] == 1.0).all() and (cache.recurrent[:, 1] == 2.0).all()
