"""Tests of the wire (server/protocol)."""
