"""State slots: which sequence holds which linear-attention state (pure Python, torch-free).

A hybrid model's sequence needs one slot of the state cache (``engine/kv/state_cache.py``)
for as long as it holds KV blocks, so the block manager takes and returns a slot wherever it
allocates, forks and frees a table. There are ``max_num_seqs`` slots: every running sequence is
a seat, so they never run short of the running set. A fork's slot starts as a copy of its
parent's (the ``(src, dst)`` pairs wait in ``pending_copies`` for the next step to run them
before its forward). A sequence's first scheduled chunk starts from zeros (``has_state`` 0),
whatever its slot held, so a freed slot needs no clearing and preemption by recompute simply
starts again.
"""

from __future__ import annotations

from collections import deque


class StateSlots:
    """Hands out ``num_slots`` slot indices to request ids."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        return self._held[request_id]

    def holders(self) -> set[str]:
        return set(self._held)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def allocate(self, request_id: str) -> int:
        """A free slot for ``request_id`` (RuntimeError when it already has one or none is
        free: the scheduler's seat count keeps that from happening)."""
        if request_id in self._held:
            raise RuntimeError(f"request {request_id!r} already holds state slot")
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are held")
        slot = self._free.popleft()
        self._held[request_id] = slot
        return slot

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` a slot that starts as a copy of the parent's."""
        self.pending_copies.append((self._held[parent_id], self.allocate(child_id)))

    def free(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is None:
            return
        # A copy into a slot given up before it ran would only be overwritten: drop it.
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d != slot]
        self._free.append(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """The fork copies to run before the next forward, handed over once."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_integrity(self, table_holders: set[str]) -> None:
        """Raise AssertionError unless exactly the requests holding blocks hold slots, each its
        own, and every other slot is free."""
        if set(self._held) != table_holders:
            raise AssertionError(
                f"state slots held by {sorted(self._held)}, blocks by {sorted(table_holders)}"
            )
        held = list(self._held.values())
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise AssertionError("a state slot is held twice or both held and free")
        if len(held) + len(self._free) != self.num_slots:
            raise AssertionError("state slots lost: held + free != total")
