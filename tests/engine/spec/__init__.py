"""Tests of engine/spec/: speculative decoding end to end, its parts, grammars under speculation."""
