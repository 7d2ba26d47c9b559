"""Tests of engine/grammar/: structured output through the engine and the JSON-schema rules'
soundness.
"""
