"""The Triton kernels: paged attention (decode and prefill chunks), KV-cache writes, KV block copy,
fused sampling with grammar masks, their argument checks and launch runtime.
"""
