"""Tests of the OpenAI-compatible server, against the real engine and default model."""
