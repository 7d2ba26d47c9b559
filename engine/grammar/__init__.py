"""Structured outputs: constraints and their compile cache (xgrammar), which JSON-schema keywords
hold, the compile budget's probe process and the server's compile queue.
"""
