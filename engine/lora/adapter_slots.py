"""Adapter slots: which adapter each of the device's ``--max-loras`` slots holds, and which
running sequences use it (pure Python, torch-free; the scheduler's side).

A sequence with an adapter is admitted only when its adapter holds a slot or one can be given
to it: a slot that no running sequence uses, the least recently used first. So no step ever
needs more than ``max_loras`` adapters, and a slot is never rewritten under a sequence using
it. A slot given a new adapter is queued in ``pending_loads`` for the runner to fill before the
step that first uses it. A slot keeps its adapter after its last user ends (the next request
for it costs no load) until another adapter needs the slot, or the adapter is unloaded
(``retire``): then the slot is emptied whenever no running sequence uses it. The requests
accepted before the unload still finish on the adapter (one still waiting loads it again).
"""

from __future__ import annotations

from collections import Counter

from paged_serve.engine.lora.adapter_files import LoRAAdapter


class AdapterSlots:
    """``num_slots`` slots, each empty or holding one adapter for its users (request ids)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one adapter slot, got {num_slots}")
        self.num_slots = num_slots
        self._adapter: list[LoRAAdapter | None] = [None] * num_slots
        self._users: list[set[str]] = [set() for _ in range(num_slots)]
        self._last_used = [0] * num_slots  # the tick of the slot's latest take
        self._tick = 0
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._held: dict[str, int] = {}  # request id -> slot
        self._retired: set[int] = set()  # adapter ids unloaded, their slots emptied when unused
        self.pending_loads: list[tuple[int, LoRAAdapter]] = []

    def can_take(self, adapter: LoRAAdapter) -> bool:
        """Whether a sequence of ``adapter`` could be given a slot now."""
        return adapter.id in self._slot_of or self._free_slot() is not None

    def take(self, request_id: str, adapter: LoRAAdapter) -> int:
        """The slot ``request_id`` runs ``adapter`` in (loading it into a free slot, the least
        recently used, if it holds none); RuntimeError when none is free (``can_take``)."""
        if request_id in self._held:
            raise RuntimeError(f"request {request_id!r} already holds an adapter slot")
        slot = self._slot_of.get(adapter.id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"all {self.num_slots} adapter slots are in use")
            self._empty(slot)
            self._adapter[slot] = adapter
            self._slot_of[adapter.id] = slot
            self.pending_loads.append((slot, adapter))
        self._users[slot].add(request_id)
        self._held[request_id] = slot
        self._tick += 1
        self._last_used[slot] = self._tick
        return slot

    def release(self, request_id: str) -> None:
        """``request_id`` no longer uses its slot (ended or preempted); no-op if it held none."""
        slot = self._held.pop(request_id, None)
        if slot is None:
            return
        self._users[slot].discard(request_id)
        adapter = self._adapter[slot]
        if not self._users[slot] and adapter is not None and adapter.id in self._retired:
            self._empty(slot)

    def retire(self, adapter_id: int) -> None:
        """The adapter was unloaded (no new request names it): its slot empties whenever no
        running sequence uses it."""
        self._retired.add(adapter_id)
        slot = self._slot_of.get(adapter_id)
        if slot is not None and not self._users[slot]:
            self._empty(slot)

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        """The slots to fill before the next forward, handed over once."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def loaded(self) -> list[LoRAAdapter]:
        """The adapters the slots hold, by slot."""
        return [a for a in self._adapter if a is not None]

    def users_by_name(self) -> Counter[str]:
        """Running sequences per adapter name."""
        return Counter(
            adapter.name
            for adapter, users in zip(self._adapter, self._users)
            if adapter is not None
            for _ in users
        )

    def _free_slot(self) -> int | None:
        """A slot no running sequence uses: an empty one first, else the least recently used."""
        unused = [s for s in range(self.num_slots) if not self._users[s]]
        if not unused:
            return None
        return min(unused, key=lambda s: (self._adapter[s] is not None, self._last_used[s]))

    def _empty(self, slot: int) -> None:
        adapter = self._adapter[slot]
        if adapter is None:
            return
        del self._slot_of[adapter.id]
        self._adapter[slot] = None
        # a load queued for a slot emptied before it ran would only be overwritten: drop it
        self.pending_loads = [(s, a) for s, a in self.pending_loads if s != slot]

    def check_integrity(self, running: dict[str, int]) -> None:
        """Raise AssertionError unless exactly the ``running`` request ids (with their adapter
        ids) hold slots, each in the slot of its adapter."""
        held = {rid: self._adapter[slot] for rid, slot in self._held.items()}
        if {rid: a.id if a else None for rid, a in held.items()} != running:
            raise AssertionError(f"adapter slots held by {sorted(held)}, expected {running}")
        for slot, users in enumerate(self._users):
            if users and self._adapter[slot] is None:
                raise AssertionError(f"adapter slot {slot} is empty but used by {sorted(users)}")
        if len(self._slot_of) != sum(a is not None for a in self._adapter):
            raise AssertionError("an adapter is in two slots, or a slot is not indexed")
