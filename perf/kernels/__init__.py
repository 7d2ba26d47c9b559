"""GPU kernel benchmarks, collected by ``pytest perf/`` where CUDA is present.

One ``test_*.py`` per kernel family of ``kernels/triton/`` (paged attention, MLA attention, fused
MoE, the gated delta rule, KV-cache writes and block copies, fused sampling), each against the
eager reference or the torch code it replaces, and their shared pieces: ``cuda_timing.py`` (CUDA
events, cold L2, CUDA graphs) and ``report.py`` (the end-of-session table and its JSON).
``perf/conftest.py`` skips them all without CUDA.
"""
