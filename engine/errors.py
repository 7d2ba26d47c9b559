"""Errors the engine raises to its callers."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never run. ``param`` names the request field at fault (the
    server reports it in the OpenAI error object), or None when the prompt itself is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can make progress."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting`` allows."""
