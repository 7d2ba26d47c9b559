"""The KV block pool: free list, per-request block tables, reference counts, prefix cache.

Pure Python and torch-free: it hands out block ids; the model runner turns them into slots.

    free pool (LRU order, oldest first)      block tables            prefix cache
    +----+----+----+----+                    req A: [3, 7, 1]        key(root, toks) -> 3
    | 5  | 9  | 2  | 8  |  <- pop left       req B: [3, 7, 4]        key(key3, toks) -> 7
    +----+----+----+----+     push right     (3, 7 have ref 2)       key(...) -> 9 (free, cached)

* A block with ``ref_count == 0`` sits in the free pool. If it still carries a hash it is a
  *cached* block: a later request with the same prefix takes it back out of the pool without
  recomputing it; otherwise it is evicted (its hash dropped) when the pool hands it out.
* Blocks are keyed only when full and computed. The key chains over (parent key, token ids)
  through a keyed BLAKE2b digest (the key drawn per process, so nobody can precompute
  colliding prefixes). A chain starts at its *root*: empty, or the digest of the request's
  cache salt (``chain_root``; the server salts with the tenant, so one tenant's prefixes never
  hit for another). A request keeps its root from ``allocate`` to ``free`` and hands it to its
  forks, so every block it commits extends the same salted chain. A hit is never taken on the
  key alone: the block's token ids and root must match, and so must its parent, the block a hit
  was just confirmed at, in the same *generation* (a block's generation counts its reuses, so a
  parent evicted and refilled since no longer matches). By induction a hit holds exactly the
  requested prefix, in the requested chain.
* A request releases its blocks last-first, so leaves are evicted before their parents.
* Shared blocks are never written: prefix hits stop before the block holding the last prompt
  token, and a forked request copies its shared partial last block before writing (the copy
  pairs go to the block-copy kernel).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from paged_serve.engine.sched.state_slots import StateSlots

_PROCESS_KEY = os.urandom(32)  # keys the prefix digests: they differ in every process


def prefix_key(parent_key: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The cache key of a full block: a digest of its parent block's key and its token ids."""
    payload = parent_key + array("q", token_ids).tobytes()
    return hashlib.blake2b(payload, digest_size=32, key=_PROCESS_KEY).digest()


def chain_root(cache_salt: str | None) -> bytes:
    """Where a request's prefix chain starts: empty without a salt (every unsalted request
    shares it), else a digest of the salt, domain-separated from block keys by ``person``."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(
        cache_salt.encode(), digest_size=32, key=_PROCESS_KEY, person=b"cache-salt"
    ).digest()


# The parent of a block in a prefix chain: (block id, its generation), or None for a first block.
ParentRef = tuple[int, int] | None


RECENT_COPIES = 16  # copy-on-write pairs kept for the dashboard


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for the requested allocation."""


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
class _Block:
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


class BlockManager:
    """Allocates fixed-size KV blocks to requests.

    num_blocks: pool size; block_size: tokens per block. ``state_slots`` (a hybrid model's
    linear-attention state, ``engine/sched/state_slots.py``): a slot goes with every table, taken
    at ``allocate``/``fork`` and given back at ``free``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        state_slots: StateSlots | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}
        self._hashed: dict[str, int] = {}  # request -> number of its leading blocks hashed
        self._roots: dict[str, bytes] = {}  # request -> chain_root of its cache salt
        self._cache: dict[bytes, int] = {}  # prefix_key -> block id
        self._num_cached_free = 0  # free blocks that still carry a key (kept for usage())
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
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks the prefix cache still holds, reusable until evicted (O(1))."""
        return self._num_cached_free

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Block ids of the longest cached run of leading full blocks of ``token_ids``, in the
        chain of ``cache_salt`` (only blocks committed under the same salt hit).

        Stops before the block holding the last token: that token's logits are needed, so it is
        always recomputed, and a shared block is never written.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        root = key = chain_root(cache_salt)
        parent: ParentRef = None
        for i in range((len(token_ids) - 1) // self.block_size):
            toks = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = prefix_key(key, toks)
            block_id = self._cache.get(key)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.token_ids != toks or block.parent != parent or block.root != root:
                break
            hits.append(block_id)
            parent = block.ref
        return hits

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` for ``num_tokens`` tokens (reusing ``cached_blocks``) would fit."""
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self._blocks[b].ref_count == 0)
        slot_free = self.state_slots is None or self.state_slots.num_free > 0
        return fresh + revived <= len(self._free) and slot_free

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to hold ``num_tokens`` tokens."""
        return self._fresh_blocks_needed(request_id, num_tokens) <= len(self._free)

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
                f"{len(self._free)} free"
            )
        if self.state_slots is not None and not self.state_slots.num_free:
            raise OutOfBlocksError("no free state slot")
        table: list[int] = []
        for block_id in cached_blocks:
            self._take(block_id)
            table.append(block_id)
        self._tables[request_id] = table
        self._num_tokens[request_id] = len(cached_blocks) * self.block_size
        self._hashed[request_id] = len(cached_blocks)
        self._roots[request_id] = chain_root(cache_salt)
        self.append_slots(request_id, num_tokens)
        if self.state_slots is not None:
            self.state_slots.allocate(request_id)
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
        if needed > len(self._free):
            raise OutOfBlocksError(
                f"request {request_id!r} needs {needed} more blocks, {len(self._free)} free"
            )
        copies: list[tuple[int, int]] = []
        write_from = old_tokens // self.block_size
        if num_tokens > old_tokens and write_from < len(table):
            shared = table[write_from]
            if self._blocks[shared].ref_count > 1:
                fresh = self._pop_free()
                self._blocks[fresh].num_tokens = self._blocks[shared].num_tokens
                self._blocks[shared].ref_count -= 1
                table[write_from] = fresh
                copies.append((shared, fresh))
                self.copy_on_write_total += 1
                self.recent_copies.append((shared, fresh))
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._pop_free())
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
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.num_tokens = 0
                self._free[block_id] = None
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
                block.block_hash = prefix_key(above.block_hash if above else root, toks)
                block.token_ids = toks
                block.parent = above.ref if above else None
                block.root = root
                self._cache.setdefault(block.block_hash, block.block_id)
        self._hashed[request_id] = max(start, full)

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
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    block.num_tokens = 0
                else:
                    self._num_cached_free += 1
                self._free[block_id] = None

    def evict_cached(self) -> int:
        """Drop the cache entry of every free block (``/flush_cache``); returns how many. A
        block some request holds keeps its key (its prefix is still being shared), so after
        this on an idle pool no earlier prefix can hit."""
        evicted = 0
        for block_id in self._free:
            block = self._blocks[block_id]
            if block.block_hash is None:
                continue
            if self._cache.get(block.block_hash) == block_id:
                del self._cache[block.block_hash]
            block.block_hash, block.token_ids, block.parent, block.root = None, (), None, b""
            block.num_tokens = 0
            evicted += 1
        self._num_cached_free = 0
        return evicted

    # ----------------------------------------------------------------- metrics
    def usage(self) -> BlockUsage:
        """Usage over blocks held by live requests (cached-but-free blocks are not used)."""
        used = [b for b in self._blocks if b.ref_count > 0]
        allocated = sum(b.num_tokens for b in used)
        reserved = len(used) * self.block_size
        cached = sum(1 for b in self._free if self._blocks[b].block_hash is not None)
        return BlockUsage(
            allocated_tokens=allocated,
            reserved_tokens=reserved,
            internal_fragmentation_tokens=reserved - allocated,
            block_utilization=round(allocated / reserved, 4) if reserved else 0.0,
            used_blocks=len(used),
            free_blocks=len(self._free),
            cached_blocks=cached,
        )

    def pool_map(self) -> str:
        """One character per block, by block id: ``.`` free, ``c`` free but cached (a prefix
        cache entry, evictable), ``u`` held by one request, ``s`` shared (ref count > 1).

        Counts agree with ``usage()``: ``u`` + ``s`` = used, ``c`` = cached, ``.`` + ``c`` = free.
        """
        pool = bytearray(b"." * self.num_blocks)
        for block_id in self._free:
            if self._blocks[block_id].block_hash is not None:
                pool[block_id] = 0x63  # c
        for table in self._tables.values():
            for block_id in table:
                pool[block_id] = 0x75 if self._blocks[block_id].ref_count == 1 else 0x73  # u, s
        return pool.decode("ascii")

    def check_integrity(self) -> None:
        """Raise AssertionError if reference counts, the free pool or the cache disagree."""
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(table) != self.blocks_for(self._num_tokens[request_id]):
                raise AssertionError(f"{request_id!r}: table length does not match its tokens")
            for block_id in table:
                refs[block_id] += 1
        for block in self._blocks:
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
        for h, block_id in self._cache.items():
            if self._blocks[block_id].block_hash != h:
                raise AssertionError(
                    f"cache entry {h} points at block {block_id} with another hash"
                )
        if set(self._roots) != set(self._tables):
            raise AssertionError("chain roots and block tables name different requests")
        if len(self._free) + sum(1 for r in refs if r) != self.num_blocks:
            raise AssertionError("blocks lost: free + used != total")
        cached = sum(1 for b in self._free if self._blocks[b].block_hash is not None)
        if cached != self._num_cached_free:
            raise AssertionError(f"{cached} cached free blocks, counted {self._num_cached_free}")
        if self.state_slots is not None:
            self.state_slots.check_integrity(set(self._tables))

    # ----------------------------------------------------------------- internals
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

    def _take(self, block_id: int) -> None:
        """Reference a cached block, reviving it from the free pool if no one held it."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._num_cached_free -= 1  # only keyed blocks are taken back from the pool
        block.ref_count += 1

    def _pop_free(self) -> int:
        """Hand out the least recently freed block, evicting its cache entry."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._num_cached_free -= 1
            if self._cache.get(block.block_hash) == block_id:
                del self._cache[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            block.parent = None
            block.root = b""
        block.generation += 1
        block.ref_count = 1
        block.num_tokens = 0
        return block_id
