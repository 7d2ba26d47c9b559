"""Tests of from a request to engine requests (server/generation)."""
