"""Tests of the Responses API (server/responses)."""
