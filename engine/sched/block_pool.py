"""The KV block pool: every block's record and the free list, O(1) to take from and give back to.

Pure Python and torch-free: it hands out block ids; the model runner turns them into slots.

    free list (LRU order, oldest first)
    +----+----+----+----+
    | 5  | 9  | 2  | 8  |  <- pop left (pop_free)      9: free but still cached (keyed)
    +----+----+----+----+     push right (release)

* A block with ``ref_count == 0`` sits in the free list. If it still carries a key it is a
  *cached* block: a later request with the same prefix takes it back out (``take``) without
  recomputing it; otherwise it loses its key when the pool hands it out (``pop_free``, which
  calls ``forget_key``: the prefix cache's ``forget``).
* Requests release their blocks last-first, so leaves are evicted before their parents.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# The parent of a block in a prefix chain: (block id, its generation), or None for a first block.
ParentRef = tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class BlockUsage:
    """Pool usage. Token counts are KV slots; utilization = allocated / reserved."""

    allocated_tokens: int
    reserved_tokens: int
    internal_fragmentation_tokens: int
    block_utilization: float
    used_blocks: int
    free_blocks: int
    cached_blocks: int


@dataclass(slots=True)
class Block:
    """One KV block: its reference count and fill, and its prefix-cache key while it has one
    (engine/sched/prefix_cache.py)."""

    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # slots filled (as seen by the tables holding it)
    block_hash: bytes | None = None  # prefix_key of its content, while cached
    token_ids: tuple[int, ...] = ()
    parent: ParentRef = None  # the block before it in the prefix it was cached for
    generation: int = 0  # times the block was handed out: a parent reference dates from one
    root: bytes = b""  # chain_root of the chain it was cached in (a hit must match it too)

    @property
    def ref(self) -> tuple[int, int]:
        """How a child block names this block as its parent."""
        return (self.block_id, self.generation)


class BlockPool:
    """``num_blocks`` block records and the free list; ``forget_key(block)`` drops a block's
    prefix-cache key when it is handed out again or flushed."""

    def __init__(self, num_blocks: int, forget_key: Callable[[Block], None]):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._forget_key = forget_key
        self.num_cached_free = 0  # free blocks that still carry a key (kept for usage())

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    def take(self, block_id: int) -> None:
        """Reference a cached block, reviving it from the free list if no one held it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self.num_cached_free -= 1  # only keyed blocks are taken back from the pool
        block.ref_count += 1

    def pop_free(self) -> int:
        """Hand out the least recently freed block, evicting its cache key."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.num_cached_free -= 1
            self._forget_key(block)
        block.generation += 1
        block.ref_count = 1
        block.num_tokens = 0
        return block_id

    def release(self, block_id: int) -> None:
        """Drop one reference; a block no one holds goes to the free list, cached if keyed."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                block.num_tokens = 0
            else:
                self.num_cached_free += 1
            self._free[block_id] = None

    def release_trimmed(self, block_id: int) -> None:
        """Drop one reference to a block a trim cut off (written this step, never keyed by its
        request); a block no one holds goes to the free list, emptied."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            block.num_tokens = 0
            self._free[block_id] = None

    def evict_cached(self) -> int:
        """Drop the key of every free block; returns how many had one. A block some request
        holds keeps its key."""
        evicted = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            self._forget_key(block)
            block.num_tokens = 0
            evicted += 1
        self.num_cached_free = 0
        return evicted

    def usage(self, block_size: int) -> BlockUsage:
        """Usage over blocks held by live requests (cached-but-free blocks are not used)."""
        used = [b for b in self.blocks if b.ref_count > 0]
        allocated = sum(b.num_tokens for b in used)
        reserved = len(used) * block_size
        cached = sum(1 for b in self._free if self.blocks[b].block_hash is not None)
        return BlockUsage(
            allocated_tokens=allocated,
            reserved_tokens=reserved,
            internal_fragmentation_tokens=reserved - allocated,
            block_utilization=round(allocated / reserved, 4) if reserved else 0.0,
            used_blocks=len(used),
            free_blocks=len(self._free),
            cached_blocks=cached,
        )

    def pool_map(self, tables: Iterable[list[int]]) -> str:
        """One character per block, by block id: ``.`` free, ``c`` free but cached, ``u`` held
        by one of ``tables``, ``s`` shared (ref count > 1)."""
        pool = bytearray(b"." * len(self.blocks))
        for block_id in self._free:
            if self.blocks[block_id].block_hash is not None:
                pool[block_id] = 0x63  # c
        for table in tables:
            for block_id in table:
                pool[block_id] = 0x75 if self.blocks[block_id].ref_count == 1 else 0x73  # u, s
        return pool.decode("ascii")

    def check_references(self, refs: list[int]) -> None:
        """Raise AssertionError unless every block's reference count is ``refs[block_id]`` (the
        tables holding it) and exactly the unreferenced blocks are free."""
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, "
                    f"held by {refs[block.block_id]} tables"
                )
            in_free = block.block_id in self._free
            if in_free != (block.ref_count == 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count}, in free pool {in_free}"
                )

    def check_counts(self, refs: list[int]) -> None:
        """Raise AssertionError if free and used blocks do not add up to the pool, or the
        count of cached free blocks drifted."""
        if len(self._free) + sum(1 for r in refs if r) != len(self.blocks):
            raise AssertionError("blocks lost: free + used != total")
        cached = sum(1 for b in self._free if self.blocks[b].block_hash is not None)
        if cached != self.num_cached_free:
            raise AssertionError(f"{cached} cached free blocks, counted {self.num_cached_free}")
