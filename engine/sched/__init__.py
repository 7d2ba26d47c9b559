"""The scheduler's side: requests and their samples, admission, chunked prefill and preemption, the
KV block pool with prefix caching, detokenizing and stop checks.
"""
