"""What one client may ask of the server: every per-request and per-connection bound, in one
frozen record that ``create_app`` takes and ``make_runner`` reads back from the app.

Each field is a ``paged-serve`` flag of the same name (``max_request_bytes`` is
``--max-request-bytes``, ``header_timeout_s`` is ``--header-timeout``); docs/reliability.md
lists them with the answer a client gets beyond each.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields

from paged_serve.engine.sampling_params import MAX_LOGPROBS, MAX_N

ANY_HOST = "*"  # in allowed_hosts: no Host or Origin check at all


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
    write_timeout_s: seconds a response write may go without the client taking any of it (its
        writes paused and the buffer not shrinking); then the connection is aborted, and the
        requests it was streaming with it. llama.cpp's default.
    max_unsent_bytes: bytes a stream may have produced but not sent (waiting to be written,
        or in the transport's buffer); beyond, the client is not keeping up: its requests are
        aborted and the connection closed, instead of generating the whole answer into memory.
    max_prompt_logprob_entries: entries a reply's ``prompt_logprobs`` may hold, prompt tokens x
        (``prompt_logprobs`` + 1) summed over its lists (completions: one per choice); about
        70 bytes of JSON each (400 naming ``prompt_logprobs`` beyond).
    max_logprobs: the most alternatives per token a request may ask for in ``logprobs``,
        ``top_logprobs`` or ``prompt_logprobs`` (400 naming the field beyond), 0 to 20
        (vLLM's ``--max-logprobs``).
    max_background_responses: background Responses runs (``background: true``) not yet
        finished, all keys together (503 beyond). Each holds an engine request and, streamed,
        up to 16 MiB of events (``server.responses.background.MAX_EVENT_BYTES``); 128 keeps twice
        the engine's default batch (``--max-num-seqs`` 64) in flight.
    max_background_responses_per_key: unfinished background runs one API key may hold (429
        beyond); with API keys only (without, all requests are one tenant, bounded by the
        total). A quarter of the default total, so no key can fill it alone.
    allowed_hosts: host names (no port) a request's Host header may carry besides the loopback
        ones, when the server listens on loopback only; and Origin hosts trusted besides the
        server's own. ``"*"`` turns the Host and Origin checks off
        (``paged_serve.server.http.browser_guard``).
    """

    max_request_bytes: int = 1 << 20
    max_sequences_per_request: int = MAX_N
    max_stored_responses: int = 1000
    max_response_store_bytes: int = 128 << 20
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 1000
    write_timeout_s: float = 600.0
    max_unsent_bytes: int = 4 << 20
    max_prompt_logprob_entries: int = 1 << 18
    max_logprobs: int = MAX_LOGPROBS
    max_background_responses: int = 128
    max_background_responses_per_key: int = 32
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        minimum = {"max_stored_responses": 0, "max_response_store_bytes": 0, "max_logprobs": 0}
        if isinstance(self.max_logprobs, int) and self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be at most {MAX_LOGPROBS}, got {self.max_logprobs}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "allowed_hosts":
                object.__setattr__(self, f.name, tuple(host_name(h) for h in value))
            elif f.name.endswith("_s"):
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"{f.name} must be finite seconds > 0, got {value}")
            elif not isinstance(value, int) or value < minimum.get(f.name, 1):
                raise ValueError(
                    f"{f.name} must be an integer >= {minimum.get(f.name, 1)}, got {value!r}"
                )

    @property
    def any_host(self) -> bool:
        """No Host or Origin check (``allowed_hosts`` holds ``"*"``)."""
        return ANY_HOST in self.allowed_hosts


def host_name(host: str) -> str:
    """``host`` as the checks compare it: lowercase, no brackets around an IPv6 address, no
    trailing dot; ``ValueError`` for an empty name or one with a port, path or spaces."""
    name = host.strip().lower().removesuffix(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == ANY_HOST:
        return name
    if ":" in name:
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise ValueError(
                f"allowed_hosts must be host names without a port, got {host!r}"
            ) from None
    if not name or any(c in name for c in "/ \t@"):
        raise ValueError(f"allowed_hosts must be host names without a port, got {host!r}")
    return name
