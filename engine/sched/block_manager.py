"""Per-request block tables over the KV block pool, with copy-on-write and the prefix cache.

Pure Python and torch-free: it hands out block ids; the model runner turns them into slots.

    block tables              pool (engine/sched/block_pool.py)    prefix cache (prefix_cache.py)
    req A: [3, 7, 1]          free list, LRU: [5, 9, 2, 8]          key(root, toks) -> 3
    req B: [3, 7, 4]          ref counts: 3, 7 held twice            key(key3, toks) -> 7
                                                                     key(...) -> 9 (free, cached)

* A request's table grows as it runs (``allocate``, ``append_slots``), shrinks past rejected
  drafts (``trim``) and goes back to the pool last-first at ``free``, so leaves are evicted
  before their parents. Its full, computed blocks are keyed in the prefix cache (``commit``)
  in the chain of its cache salt: a request keeps its chain root from ``allocate`` to ``free``
  and hands it to its forks, so every block it commits extends the same salted chain.
* Shared blocks are never written: prefix hits stop before the block holding the last prompt
  token, and a forked request copies its shared partial last block before writing (the copy
  pairs go to the block-copy kernel).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from paged_serve.engine.sched.block_pool import Block, BlockPool, BlockUsage
from paged_serve.engine.sched.prefix_cache import PrefixCache, chain_root
from paged_serve.engine.sched.state_slots import StateSlots
from paged_serve.engine.sched.state_snapshots import StateSnapshots

RECENT_COPIES = 16  # copy-on-write pairs kept for the dashboard


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for the requested allocation."""


class BlockManager:
    """Allocates fixed-size KV blocks to requests.

    num_blocks: pool size; block_size: tokens per block. ``state_slots`` (a hybrid model's
    linear-attention state, ``engine/sched/state_slots.py``): a slot goes with every table, taken
    at ``allocate``/``fork`` and given back at ``free``. ``state_snapshots``
    (``state_snapshots.py``): states kept at block boundaries, without which a model with state
    slots gets no prefix hits.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        state_slots: StateSlots | None = None,
        state_snapshots: StateSnapshots | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self.snapshots = state_snapshots if state_slots is not None else None
        self._cache = PrefixCache(block_size)
        self._pool = BlockPool(num_blocks, forget_key=self._forget_key)
        self._blocks = self._pool.blocks  # records by block id
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        self._hashed: dict[str, int] = {}  # request -> number of its leading blocks hashed
        self._roots: dict[str, bytes] = {}  # request -> chain_root of its cache salt
        # Copy-on-write so far, and the last few (src, dst) pairs (the dashboard flashes them).
        self.copy_on_write_total = 0
        self.recent_copies: deque[tuple[int, int]] = deque(maxlen=RECENT_COPIES)

    # ----------------------------------------------------------------- queries
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some live request holds (O(1), for per-step gauges)."""
        return self.num_blocks - self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks the prefix cache still holds, reusable until evicted (O(1))."""
        return self._pool.num_cached_free

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return self._pool.num_free

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Block ids of the longest cached run of leading full blocks of ``token_ids``, in the
        chain of ``cache_salt`` (only blocks committed under the same salt hit).

        Stops before the block holding the last token: that token's logits are needed, so it is
        always recomputed, and a shared block is never written. With state slots, stops after
        the last block with a state snapshot (none without snapshots).
        """
        if not self.enable_prefix_caching:
            return []
        if self.state_slots is not None and self.snapshots is None:
            return []  # no state kept to resume from
        hits = self._cache.lookup(self._blocks, token_ids, cache_salt)
        return hits if self.snapshots is None else hits[: self.snapshots.resumable(hits)]

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` for ``num_tokens`` tokens (reusing ``cached_blocks``) would fit."""
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self._blocks[b].ref_count == 0)
        slot_free = self.state_slots is None or self.state_slots.num_free > 0
        return fresh + revived <= self._pool.num_free and slot_free

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens."""
        return self._fresh_blocks_needed(request_id, num_tokens) <= self._pool.num_free

    # ----------------------------------------------------------------- changes
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached_blocks: Sequence[int] = (),
        cache_salt: str | None = None,
    ) -> list[int]:
        """Create the table of a new request holding ``num_tokens`` tokens.

        The leading ``cached_blocks`` (from ``cached_prefix`` with the same ``cache_salt``) are
        shared, the rest are fresh; the blocks the request commits are keyed in the chain of
        ``cache_salt``. Raises OutOfBlocksError (changing nothing) if the pool is short.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        if len(cached_blocks) * self.block_size > num_tokens:
            raise ValueError("cached blocks cover more than the allocation")
        if not self.can_allocate(num_tokens, cached_blocks):
            raise OutOfBlocksError(
                f"need {self.blocks_for(num_tokens)} blocks for {num_tokens} tokens, "
                f"{self._pool.num_free} free"
            )
        if self.state_slots is not None and not self.state_slots.num_free:
            raise OutOfBlocksError("no free state slot")
        table: list[int] = []
        for block_id in cached_blocks:
            self._pool.take(block_id)
            table.append(block_id)
        self._tables[request_id] = table
        self._num_tokens[request_id] = len(cached_blocks) * self.block_size
        self._hashed[request_id] = len(cached_blocks)
        self._roots[request_id] = chain_root(cache_salt)
        self.append_slots(request_id, num_tokens)
        if self.state_slots is not None:
            slot = self.state_slots.allocate(request_id)
            if cached_blocks:  # resume from the state after the last cached block
                row = self.snapshots.restore(cached_blocks[-1])
                self.state_slots.pending_copies.append((row, slot))
        return table

    def append_slots(self, request_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the request's table to hold ``num_tokens`` tokens.

        A new block is taken only when the last one is full. If the block about to be written is
        shared (after a fork), it is replaced by a private copy: the returned ``(src, dst)`` pairs
        must be copied on the device before this step's KV writes.
        Raises OutOfBlocksError (changing nothing) if the pool is short.
        """
        table = self._tables[request_id]
        old_tokens = self._num_tokens[request_id]
        if num_tokens < old_tokens:
            raise ValueError(f"cannot shrink {request_id!r} from {old_tokens} to {num_tokens}")
        needed = self._fresh_blocks_needed(request_id, num_tokens)
        if needed > self._pool.num_free:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {needed} more blocks, {self._pool.num_free} free"
            )
        copies: list[tuple[int, int]] = []
        write_from = old_tokens // self.block_size
        if num_tokens > old_tokens and write_from < len(table):
            shared = table[write_from]
            if self._blocks[shared].ref_count > 1:
                fresh = self._pool.pop_free()
                self._blocks[fresh].num_tokens = self._blocks[shared].num_tokens
                self._blocks[shared].ref_count -= 1
                table[write_from] = fresh
                copies.append((shared, fresh))
                self.copy_on_write_total += 1
                self.recent_copies.append((shared, fresh))
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._pool.pop_free())
        for i in range(write_from, len(table)):
            filled = min(self.block_size, num_tokens - i * self.block_size)
            self._blocks[table[i]].num_tokens = max(filled, 0)
        self._num_tokens[request_id] = num_tokens
        return copies

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to ``num_tokens`` tokens (a verified step's rejected
        draft positions): the blocks past them go back to the pool. Only slots beyond the
        prefix cache's keyed blocks may be trimmed (they were written this step)."""
        table = self._tables[request_id]
        if num_tokens > self._num_tokens[request_id]:
            raise ValueError(f"cannot trim {request_id!r} up to {num_tokens} tokens")
        if num_tokens < self._hashed[request_id] * self.block_size:
            raise ValueError(f"cannot trim {request_id!r} into its cached blocks")
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(table[keep:]):
            self._pool.release_trimmed(block_id)
        del table[keep:]
        if keep:
            self._blocks[table[-1]].num_tokens = num_tokens - (keep - 1) * self.block_size
        self._num_tokens[request_id] = num_tokens

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        token_ids: the request's tokens (prompt then outputs); num_computed: how many of them
        have their K/V in the cache.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        start = self._hashed[request_id]
        root = self._roots[request_id]
        full = min(num_computed // self.block_size, len(table))
        for i in range(start, full):
            block = self._blocks[table[i]]
            if block.block_hash is None:  # else a cache hit, or shared with its fork
                above = self._blocks[table[i - 1]] if i > 0 else None
                toks = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                # Blocks are keyed in order, so the block above already has its key.
                self._cache.key(block, above, root, toks)
        self._hashed[request_id] = max(start, full)
        snapshots = self.snapshots
        boundary = full * self.block_size == num_computed and snapshots is not None
        if boundary and snapshots.at_boundary(num_computed):
            block = table[full - 1]
            if self._blocks[block].block_hash is not None and not snapshots.has(block):
                slot = self.state_slots.slot(request_id)
                self.state_slots.pending_copies.append((slot, snapshots.save(block)))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared by reference count (copy-on-write)."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        table = list(self._tables[parent_id])
        for block_id in table:
            self._blocks[block_id].ref_count += 1
        self._tables[child_id] = table
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._hashed[child_id] = self._hashed[parent_id]
        self._roots[child_id] = self._roots[parent_id]
        if self.state_slots is not None:
            self.state_slots.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (last first, so leaves are evicted before parents)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        if self.state_slots is not None:
            self.state_slots.free(request_id)
        del self._num_tokens[request_id]
        del self._hashed[request_id]
        del self._roots[request_id]
        for block_id in reversed(table):
            self._pool.release(block_id)

    def evict_cached(self) -> int:
        """Drop the cache entry of every free block (``/flush_cache``); returns how many. A
        block some request holds keeps its key (its prefix is still being shared), so after
        this on an idle pool no earlier prefix can hit."""
        return self._pool.evict_cached()

    # ----------------------------------------------------------------- metrics
    def usage(self) -> BlockUsage:
        """Usage over blocks held by live requests (cached-but-free blocks are not used)."""
        return self._pool.usage(self.block_size)

    def pool_map(self) -> str:
        """One character per block, by block id: ``.`` free, ``c`` free but cached (a prefix
        cache entry, evictable), ``u`` held by one request, ``s`` shared (ref count > 1).

        Counts agree with ``usage()``: ``u`` + ``s`` = used, ``c`` = cached, ``.`` + ``c`` = free.
        """
        return self._pool.pool_map(self._tables.values())

    def check_integrity(self) -> None:
        """Raise AssertionError if reference counts, the free pool or the cache disagree."""
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(table) != self.blocks_for(self._num_tokens[request_id]):
                raise AssertionError(f"{request_id!r}: table length does not match its tokens")
            for block_id in table:
                refs[block_id] += 1
        self._pool.check_references(refs)
        self._cache.check_integrity(self._blocks)
        if set(self._roots) != set(self._tables):
            raise AssertionError("chain roots and block tables name different requests")
        self._pool.check_counts(refs)
        if self.state_slots is not None:
            self.state_slots.check_integrity(set(self._tables))
        if self.snapshots is not None:
            self.snapshots.check_integrity(self._blocks)

    # ----------------------------------------------------------------- internals
    def _forget_key(self, block: Block) -> None:
        self._cache.forget(block)
        if self.snapshots is not None:
            self.snapshots.forget(block.block_id)

    def _fresh_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        table = self._tables[request_id]
        needed = max(self.blocks_for(num_tokens) - len(table), 0)
        old_tokens = self._num_tokens[request_id]
        write_from = old_tokens // self.block_size
        if (
            num_tokens > old_tokens
            and write_from < len(table)
            and self._blocks[table[write_from]].ref_count > 1
        ):
            needed += 1  # copy-on-write of the shared partial block
        return needed
