"""What one client may ask of the server: every per-request and per-connection bound, in one
frozen record that ``create_app`` takes and ``make_runner`` reads back from the app.

Each field is a ``paged-serve`` flag of the same name (``max_request_bytes`` is
``--max-request-bytes``, ``header_timeout_s`` is ``--header-timeout``); docs/reliability.md
lists them with the answer a client gets beyond each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.sampling_params import MAX_N


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds on requests and connections; ``ValueError`` for a value out of range.

    max_request_bytes: the largest request body, bytes (413 beyond).
    max_sequences_per_request: sequences one request may start: prompts x ``n`` for completions,
        ``n`` for chat (400 naming ``n`` or ``prompt`` beyond). The default is OpenAI's largest
        ``n``, so every single-prompt request OpenAI accepts is accepted.
    max_stored_responses: entries in the Responses API store (least recently used evicted).
    max_response_store_bytes: the store's budget, bytes of stored JSON (least recently used
        evicted; a response larger than the whole budget is not stored).
    header_timeout_s: seconds a connection has to deliver a complete request head, counted from
        when it opens or its previous response ended (so also the idle keep-alive timeout).
    body_timeout_s: seconds a request has to deliver its whole body once its head is in (408).
    max_connections: open connections; at the cap a new one closes the longest-idle connection
        that is not running a request, or is refused with 503 if every one is.
    """

    max_request_bytes: int = 1 << 20
    max_sequences_per_request: int = MAX_N
    max_stored_responses: int = 1000
    max_response_store_bytes: int = 128 << 20
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 1000

    def __post_init__(self) -> None:
        minimum = {"max_stored_responses": 0, "max_response_store_bytes": 0}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"{f.name} must be finite seconds > 0, got {value}")
            elif not isinstance(value, int) or value < minimum.get(f.name, 1):
                raise ValueError(
                    f"{f.name} must be an integer >= {minimum.get(f.name, 1)}, got {value!r}"
                )
