"""Tests of the OpenAI- and vLLM-compatible endpoints (server/openai)."""
