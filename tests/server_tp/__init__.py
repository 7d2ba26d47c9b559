"""The OpenAI-client server tests again on a tensor-parallel engine (TP=3, gloo, CPU)."""
