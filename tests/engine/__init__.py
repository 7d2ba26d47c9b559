"""Tests of the engine, folder for folder as engine/ is laid out; here the engine's root: the
offline and async APIs, the CLI, validation, limits, fault isolation, and greedy equality with
Hugging Face.
"""
