"""Tests of the HTTP layer (server/http)."""
