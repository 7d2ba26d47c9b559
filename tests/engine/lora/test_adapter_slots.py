"""``AdapterSlots``: a slot per adapter in use, the least recently used unused slot given to a
new adapter, loads queued once, unloaded adapters emptied when their last user ends."""

from __future__ import annotations

import pytest

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.lora.adapter_slots import AdapterSlots

A, B, C = (LoRAAdapter(i, name, f"/x/{name}", 8) for i, name in enumerate("abc", start=1))


def test_requests_of_one_adapter_share_its_slot_and_load_it_once():
    slots = AdapterSlots(2)
    assert slots.take("r1", A) == slots.take("r2", A)
    assert slots.take_loads() == [(0, A)]
    assert slots.take_loads() == []
    assert slots.users_by_name() == {"a": 2}
    slots.check_integrity({"r1": A.id, "r2": A.id})


def test_no_slot_while_every_slot_has_users():
    slots = AdapterSlots(2)
    slots.take("r1", A)
    slots.take("r2", B)
    assert not slots.can_take(C) and slots.can_take(A)
    with pytest.raises(RuntimeError, match="in use"):
        slots.take("r3", C)
    slots.release("r1")
    assert slots.can_take(C)
    assert slots.take("r3", C) == 0  # A's slot, unused now
    assert [a.name for a in slots.loaded()] == ["c", "b"]


def test_the_least_recently_used_unused_slot_is_replaced_and_a_kept_adapter_costs_no_load():
    slots = AdapterSlots(2)
    slots.take("r1", A)
    slots.take("r2", B)
    slots.take_loads()
    slots.release("r2")
    slots.release("r1")  # A used last
    slots.take("r3", A)
    assert slots.take_loads() == []  # still in its slot
    slots.release("r3")
    slots.take("r4", C)
    assert slots.take_loads() == [(1, C)]  # B's slot: the least recently used


def test_retired_adapter_empties_when_its_last_user_ends():
    slots = AdapterSlots(1)
    slots.take("r1", A)
    slots.retire(A.id)
    assert slots.loaded() == [A]  # r1 still runs on it
    slots.release("r1")
    assert slots.loaded() == []
    slots.take("r2", A)  # a request accepted before the unload loads it again
    assert slots.take_loads() == [(0, A)]
    slots.release("r2")
    assert slots.loaded() == []


def test_a_load_for_a_slot_emptied_before_the_step_is_dropped():
    slots = AdapterSlots(1)
    slots.take("r1", A)
    slots.release("r1")
    slots.retire(A.id)
    assert slots.take_loads() == []


def test_integrity_catches_a_stray_holder():
    slots = AdapterSlots(1)
    slots.take("r1", A)
    with pytest.raises(AssertionError):
        slots.check_integrity({})
