"""Block manager: allocation arithmetic, boundaries, errors, sharing, prefix cache, integrity."""

from __future__ import annotations

import pytest

from paged_serve.engine.sched.block_manager import BlockManager, OutOfBlocksError


@pytest.mark.parametrize(
    ("tokens", "blocks"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_allocate_takes_ceil_tokens_over_block_size(tokens, blocks):
    bm = BlockManager(8, 16)
    table = bm.allocate("a", tokens)
    assert len(table) == blocks == bm.usage().used_blocks
    assert bm.usage().allocated_tokens == tokens
    assert bm.num_free_blocks == 8 - blocks
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


@pytest.mark.parametrize(("start", "grow_to", "new_blocks"), [(15, 16, 0), (16, 17, 1), (1, 15, 0)])
def test_append_takes_a_block_only_when_the_last_is_full(start, grow_to, new_blocks):
    bm = BlockManager(8, 16)
    bm.allocate("a", start)
    before = len(bm.block_table("a"))
    assert bm.append_slots("a", grow_to) == []
    assert len(bm.block_table("a")) - before == new_blocks
    bm.check_integrity()


def test_seed_figures():
    bm = BlockManager(64, 16)
    for i, n in enumerate([9, 17, 33, 5, 41, 12]):
        bm.allocate(f"r{i}", n)
    usage = bm.usage()
    assert usage.reserved_tokens == 176
    assert usage.allocated_tokens == 117
    assert usage.internal_fragmentation_tokens == 59
    assert usage.block_utilization == 0.6648
    assert usage.used_blocks == 11
    assert usage.free_blocks == 53
    bm.check_integrity()


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(3, 16)
    bm.allocate("a", 32)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", 17)
    assert not bm.has("b")
    with pytest.raises(OutOfBlocksError):
        bm.append_slots("a", 49)
    assert len(bm.block_table("a")) == 2
    assert not bm.can_allocate(17) and bm.can_allocate(16)
    bm.check_integrity()


def test_free_is_idempotent_and_duplicate_ids_are_refused():
    bm = BlockManager(4, 16)
    bm.allocate("a", 5)
    with pytest.raises(ValueError):
        bm.allocate("a", 5)
    bm.free("a")
    bm.free("a")
    bm.check_integrity()
    assert bm.num_free_blocks == 4


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(8, 16)
    bm.allocate("parent", 20)  # one full block, one partial
    bm.fork("parent", "child")
    assert bm.block_table("child") == bm.block_table("parent")
    assert bm.usage().used_blocks == 2
    bm.check_integrity()
    copies = bm.append_slots("child", 21)
    shared_full, old_partial = bm.block_table("parent")
    assert bm.block_table("child")[0] == shared_full
    assert copies == [(old_partial, bm.block_table("child")[1])]
    assert bm.append_slots("parent", 21) == []  # the parent now owns its block alone
    bm.check_integrity()
    bm.free("parent")
    bm.free("child")
    bm.check_integrity()
    assert bm.usage().used_blocks == 0


def _computed(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """Allocate and mark every token computed, as the engine does after a step."""
    bm.allocate(rid, len(tokens), bm.cached_prefix(tokens))
    bm.commit(rid, tokens, len(tokens))


def test_prefix_hits_reuse_full_blocks_and_recompute_the_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(12))  # exactly three blocks
    _computed(bm, "a", prompt)
    # The last token's block is never a hit: its logits are needed.
    assert bm.cached_prefix(prompt) == bm.block_table("a")[:2]
    longer = prompt + [99, 98]
    assert bm.cached_prefix(longer) == bm.block_table("a")[:3]
    assert bm.cached_prefix([0, 1, 2, 7, 4, 5, 6, 7, 8]) == []
    bm.free("a")
    assert bm.usage().used_blocks == 0 and bm.usage().cached_blocks == 3
    # Freed blocks stay reusable until the pool needs them.
    _computed(bm, "b", longer)
    assert bm.block_table("b")[:3] == bm.cached_prefix(longer)
    bm.check_integrity()


def test_hit_needs_matching_tokens_not_only_a_matching_hash():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    block = bm.block_table("a")[0]
    bm._blocks[block].token_ids = (9, 9, 9, 9)  # simulate a hash collision
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == []


def test_eviction_is_lru_and_drops_the_cache_entry():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    _computed(bm, "a", [1, 2, 3, 4, 5])  # 2 blocks, first one hashed
    bm.free("a")
    _computed(bm, "b", list(range(10, 26)))  # needs all 4 blocks: evicts the cached one
    assert bm.cached_prefix([1, 2, 3, 4, 5]) == []
    bm.check_integrity()
    bm.free("b")
    bm.check_integrity()


def test_cached_blocks_revived_from_the_free_pool_count_against_it():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    _computed(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.free("a")
    hits = bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(hits) == 2
    assert bm.can_allocate(12, hits)  # 2 revived + 1 fresh = 3
    assert not bm.can_allocate(13, hits)
    bm.allocate("b", 12, hits)
    bm.check_integrity()


def test_evict_cached_drops_every_free_entry_and_keeps_held_ones():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    _computed(bm, "a", list(range(9)))  # 3 blocks, 2 hashed
    _computed(bm, "b", [50, 51, 52, 53, 54])  # 2 blocks, 1 hashed
    bm.free("a")
    assert bm.num_cached_blocks == 2
    assert bm.evict_cached() == 2
    assert bm.num_cached_blocks == 0 and bm.usage().cached_blocks == 0
    assert bm.cached_prefix(list(range(9))) == []
    assert bm.cached_prefix([50, 51, 52, 53, 54]) == bm.block_table("b")[:1]  # still held
    bm.check_integrity()
    bm.free("b")
    assert bm.evict_cached() == 1 and bm.evict_cached() == 0
    assert bm.pool_map() == "." * 8
    bm.check_integrity()
