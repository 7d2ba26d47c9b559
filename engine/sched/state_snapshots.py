"""State snapshots: a stateful model's per-sequence state kept at block boundaries, so that the
prefix cache can serve hybrid models (pure Python, torch-free).

A gated DeltaNet, Mamba-2 or short-convolution layer folds every token into one state per
sequence, so cached KV blocks alone cannot resume a sequence: the state after the cached tokens
is needed too. When a sequence's computed tokens reach a multiple of ``interval_tokens`` (the
scheduler ends prefill chunks there), its slot's state is copied into a *snapshot row* of the
state cache and tied to the KV block that ends at that boundary::

    request A's table  [b3, b7, b1, b9]            snapshots (interval: 2 blocks)
    boundary after b7  -> row 11  (copy slot -> 11)     block 7 -> row 11
    boundary after b9  -> row 12  (copy slot -> 12)     block 9 -> row 12

A later request whose prefix hits blocks ``[b3, b7, b1]`` resumes from the longest hit ending
in a snapshot (``b7``): its KV from the blocks, its state copied from row 11 into its slot
before its first chunk. A snapshot lives as long as its block stays keyed in the prefix cache
(it is dropped when the pool hands the block out again or the cache is flushed) and as long
as rows last: a new snapshot evicts the least recently used one when every row is taken.

The copies go into the state slots' ``pending_copies`` beside the fork copies, in order, and
run before the next step's forward: a save queued after a step runs before the slot is
written again, and a restore reads a row after every save queued before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from paged_serve.engine.sched.block_pool import Block

if TYPE_CHECKING:
    from paged_serve.engine.config import EngineConfig


class SnapshotRows(Protocol):
    """Where a state cache keeps its snapshot rows (engine/kv/state_cache.py's StateCache)."""

    first_snapshot_row: int
    num_snapshots: int


def state_snapshots(cache: SnapshotRows, config: EngineConfig) -> StateSnapshots | None:
    """The snapshots of ``cache``'s rows, one every ``config.state_snapshot_interval`` tokens;
    None when it keeps none (prefix caching off, or an interval of 0)."""
    if not cache.num_snapshots:
        return None
    return StateSnapshots(
        first_row=cache.first_snapshot_row,
        count=cache.num_snapshots,
        interval_tokens=config.state_snapshot_interval,
    )


class StateSnapshots:
    """``count`` snapshot rows, numbered from ``first_row`` in the state cache, each holding one
    sequence's state at a block boundary; one every ``interval_tokens`` tokens."""

    def __init__(self, *, first_row: int, count: int, interval_tokens: int):
        if count < 1 or interval_tokens < 1:
            raise ValueError(f"need rows and an interval, got {count} rows, {interval_tokens}")
        self.first_row = first_row
        self.count = count
        self.interval_tokens = interval_tokens
        self._free: list[int] = list(range(first_row + count - 1, first_row - 1, -1))
        self._rows: OrderedDict[int, int] = OrderedDict()  # block id -> row, least recent first
        self.saves_total = 0  # snapshots taken so far
        self.restores_total = 0  # prefix hits resumed from one

    @property
    def num_used(self) -> int:
        return len(self._rows)

    def at_boundary(self, num_tokens: int) -> bool:
        """Whether a state after ``num_tokens`` tokens is one to keep."""
        return num_tokens > 0 and num_tokens % self.interval_tokens == 0

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk over tokens ``[start, end)`` should end: the last boundary in it after
        ``start``, so the state there can be kept; ``end`` when it crosses none."""
        boundary = end - end % self.interval_tokens
        return boundary if boundary > start else end

    def has(self, block_id: int) -> bool:
        return block_id in self._rows

    def resumable(self, hits: Sequence[int]) -> int:
        """How many of the leading cached blocks ``hits`` a request can resume after: up to
        the last one with a snapshot (0: none has one)."""
        for count in range(len(hits), 0, -1):
            if hits[count - 1] in self._rows:
                return count
        return 0

    def restore(self, block_id: int) -> int:
        """The row holding the state after ``block_id`` (now the most recently used)."""
        self._rows.move_to_end(block_id)
        self.restores_total += 1
        return self._rows[block_id]

    def save(self, block_id: int) -> int:
        """A row for the state after ``block_id`` (the least recently used one's when all are
        taken); the caller copies the sequence's slot into it."""
        if block_id in self._rows:
            raise RuntimeError(f"block {block_id} already has a snapshot")
        if not self._free:
            _, row = self._rows.popitem(last=False)
            self._free.append(row)
        row = self._free.pop()
        self._rows[block_id] = row
        self.saves_total += 1
        return row

    def forget(self, block_id: int) -> None:
        """Drop ``block_id``'s snapshot (its block lost its prefix-cache key)."""
        row = self._rows.pop(block_id, None)
        if row is not None:
            self._free.append(row)

    def check_integrity(self, blocks: Sequence[Block]) -> None:
        """Raise AssertionError unless every snapshot belongs to a keyed block, no row is held
        twice or both held and free, and none is lost."""
        held = list(self._rows.values())
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise AssertionError("a snapshot row is held twice or both held and free")
        if len(held) + len(self._free) != self.count:
            raise AssertionError("snapshot rows lost: held + free != total")
        unkeyed = [b for b in self._rows if blocks[b].block_hash is None]
        if unkeyed:
            raise AssertionError(f"snapshots of blocks {unkeyed} that the prefix cache forgot")
