"""Stored Responses API results, for ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``.

A bounded LRU in memory: storing beyond ``capacity`` evicts the least recently used entry, and
nothing survives a restart. With API keys configured, each entry remembers the hash of the key
that stored it and is invisible to every other key (a lookup with the wrong key is a miss).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The Response object as returned, and the conversation a follow-up continues.

    messages: chat messages (``{"role", "content"}``) of the input and the output, without the
    ``instructions`` (OpenAI does not carry those over to a follow-up).
    """

    response: dict
    messages: list[dict]
    owner: str | None


class ResponseStore:
    """An LRU map from response id to StoredResponse. Not thread-safe (event loop only)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the response store capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The entry if it exists and ``owner`` stored it; refreshes its recency."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Remove the entry ``owner`` stored; False if there is none."""
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
        return True
