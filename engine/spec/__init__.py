"""Speculative decoding: drafters (prompt lookup, a draft model) behind one interface, the
per-sequence speculator and the target's verification of the drafts."""
