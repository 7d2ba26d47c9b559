"""What a completions or chat reply carries in every object it sends: id, time, model."""

from __future__ import annotations

import time

from server.state import ServerState


class ReplyEnvelope:
    """One reply's identity; ``envelope()`` wraps its choices in the OpenAI object fields."""

    def __init__(self, state: ServerState, reply_id: str, prompt_tokens: int):
        self.state = state
        self.id = reply_id
        self.created = int(time.time())  # Unix seconds, the same for every chunk of a stream
        self.prompt_tokens = prompt_tokens

    def envelope(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.served_model_name,
            "choices": choices,
            "system_fingerprint": None,
        }
