"""What one client may ask of the server: every per-request bound, in one frozen record that
``create_app`` takes.

Each field is a ``paged-serve`` flag of the same name (``max_request_bytes`` is
``--max-request-bytes``); docs/reliability.md lists them with the answer a client gets beyond
each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.sampling_params import MAX_N


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on requests; ``ValueError`` for a value out of range.

    max_request_bytes: the largest request body, bytes (413 beyond).
    max_sequences_per_request: sequences one request may start: prompts x ``n`` for completions,
        ``n`` for chat (400 naming ``n`` or ``prompt`` beyond). The default is OpenAI's largest
        ``n``, so every single-prompt request OpenAI accepts is accepted.
    max_stored_responses: entries in the Responses API store (least recently used evicted).
    max_response_store_bytes: the store's budget, bytes of stored JSON (least recently used
        evicted; a response larger than the whole budget is not stored).
    """

    max_request_bytes: int = 1 << 20
    max_sequences_per_request: int = MAX_N
    max_stored_responses: int = 1000
    max_response_store_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        minimum = {"max_stored_responses": 0, "max_response_store_bytes": 0}
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < minimum.get(f.name, 1):
                raise ValueError(
                    f"{f.name} must be an integer >= {minimum.get(f.name, 1)}, got {value!r}"
                )
