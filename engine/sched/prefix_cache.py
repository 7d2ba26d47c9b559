"""The prefix cache's index: full, computed KV blocks keyed by a hash chain over their tokens.

::

    root = chain_root(salt)                 b"" unsalted, else a digest of the cache salt
    key(block 0) = prefix_key(root, toks 0)      -> block 3
    key(block 1) = prefix_key(key(block 0), toks 1) -> block 7
    key(block 2) = ...                           -> block 9 (free, still cached)

* Blocks are keyed only when full and computed (``key``). The key chains over (parent key,
  token ids) through a keyed BLAKE2b digest (the key drawn per process, so nobody can
  precompute colliding prefixes). A chain starts at its *root*: empty, or the digest of the
  request's cache salt (``chain_root``; the server salts with the tenant, so one tenant's
  prefixes never hit for another).
* A hit is never taken on the key alone (``lookup``): the block's token ids and root must
  match, and so must its parent, the block a hit was just confirmed at, in the same
  *generation* (a block's generation counts its reuses, so a parent evicted and refilled since
  no longer matches). By induction a hit holds exactly the requested prefix, in the requested
  chain.
* A block loses its key when the pool hands it out again or the cache is flushed (``forget``).

The blocks themselves, their reference counts and the free list are the pool's
(engine/sched/block_pool.py); which request holds which block is the block manager's.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

from paged_serve.engine.sched.block_pool import Block, ParentRef

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


class PrefixCache:
    """Maps the key of a full, computed block to its block id (``block_size`` tokens a block)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._entries: dict[bytes, int] = {}  # prefix_key -> block id

    def lookup(
        self, blocks: Sequence[Block], token_ids: Sequence[int], cache_salt: str | None
    ) -> list[int]:
        """Block ids of the longest cached run of leading full blocks of ``token_ids`` in the
        chain of ``cache_salt``, each confirmed on its tokens, root and parent (``blocks``: the
        pool's records by id). Stops before the block holding the last token."""
        hits: list[int] = []
        root = key = chain_root(cache_salt)
        parent: ParentRef = None
        for i in range((len(token_ids) - 1) // self.block_size):
            toks = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            key = prefix_key(key, toks)
            block_id = self._entries.get(key)
            if block_id is None:
                break
            block = blocks[block_id]
            if block.token_ids != toks or block.parent != parent or block.root != root:
                break
            hits.append(block_id)
            parent = block.ref
        return hits

    def key(self, block: Block, above: Block | None, root: bytes, toks: tuple[int, ...]) -> None:
        """Key ``block``, now full of ``toks``, after ``above`` (its parent, already keyed; None
        for a first block) in the chain of ``root``. An older block with the same key keeps
        the entry."""
        block.block_hash = prefix_key(above.block_hash if above else root, toks)
        block.token_ids = toks
        block.parent = above.ref if above else None
        block.root = root
        self._entries.setdefault(block.block_hash, block.block_id)

    def forget(self, block: Block) -> None:
        """Drop ``block``'s key: its entry (if the entry names this block) and its fields."""
        if self._entries.get(block.block_hash) == block.block_id:
            del self._entries[block.block_hash]
        block.block_hash, block.token_ids, block.parent, block.root = None, (), None, b""

    def check_integrity(self, blocks: Sequence[Block]) -> None:
        """Raise AssertionError if an entry names a block that carries another key."""
        for h, block_id in self._entries.items():
            if blocks[block_id].block_hash != h:
                raise AssertionError(
                    f"cache entry {h} points at block {block_id} with another hash"
                )
