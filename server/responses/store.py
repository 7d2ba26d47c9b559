"""Stored Responses API results, for ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``.

A bounded LRU in memory, bounded twice: by entries (``capacity``) and by bytes (``max_bytes``).
Storing beyond either evicts least recently used entries first; an entry larger than the whole
byte budget is not stored at all (its response was still returned to the client, but a later
``GET`` is a 404). Nothing survives a restart. With API keys configured, each entry remembers
the hash of the key that stored it and is invisible to every other key (a lookup with the wrong
key is a miss).

Entries hold their JSON encoding, not Python objects, so the byte count is what the entries
really take (a dict of strings costs several times its JSON length); the few hundred bytes of
bookkeeping per entry are bounded by ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from paged_serve.server.http.wire import encode


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The Response object as returned, and the conversation a follow-up continues, as JSON.

    response: the Response object's JSON, the exact bytes ``GET`` returns.
    messages: JSON of the chat messages (``{"role", "content"}``) of the input and the output,
        without the ``instructions`` (OpenAI does not carry those over to a follow-up).
    background: the response was created with ``background: true`` (only those can be
        cancelled, ``paged_serve.server.responses.background``).
    status: the response's final status (``completed``, ``incomplete``, ``failed``,
        ``cancelled``), which decides what a cancel answers.
    """

    response: bytes
    messages: bytes
    owner: str | None
    background: bool = False
    status: str = "completed"

    @classmethod
    def encode(
        cls,
        response: object,
        messages: list[dict],
        owner: str | None,
        *,
        background: bool = False,
        status: str = "completed",
    ) -> StoredResponse:
        """``response``: the Response object (a Struct) or anything else JSON can hold."""
        return cls(_exact(encode(response)), _exact(encode(messages)), owner, background, status)

    def conversation(self) -> list[dict]:
        return msgspec.json.decode(self.messages)

    @property
    def nbytes(self) -> int:
        """What the entry counts against the store's budget, in bytes."""
        return len(self.response) + len(self.messages) + len(self.owner or "")


def _exact(encoded: bytes) -> bytes:
    """A copy that holds no more memory than its length: msgspec grows its output buffer
    geometrically and returns it as is (512 KiB of JSON can hold a 768 KiB allocation)."""
    return bytes(memoryview(encoded))


class ResponseStore:
    """An LRU map from response id to StoredResponse. Not thread-safe (event loop only)."""

    def __init__(self, capacity: int, max_bytes: int):
        if capacity < 0:
            raise ValueError(f"the response store capacity must be >= 0, got {capacity}")
        if max_bytes < 0:
            raise ValueError(f"the response store budget must be >= 0 bytes, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0  # the sum of the entries' nbytes (and their ids' lengths)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry``, evicting least recently used entries to make room; False (and
        nothing stored) if it alone is larger than the budget."""
        size = len(response_id) + entry.nbytes
        if self.capacity == 0 or size > self.max_bytes:
            return False
        self._remove(response_id)
        self._entries[response_id] = entry
        self.nbytes += size
        while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

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
        self._remove(response_id)
        return True

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= len(response_id) + entry.nbytes
