"""Benchmarks (timing lives here, never in ``tests/``), imported as ``perf.*`` from the
repository root.

* ``kernels/``: the Triton kernels on a GPU, the only benchmarks ``pytest perf/`` collects
  (skipped without CUDA; ``perf/conftest.py``).
* ``engine/``: the engine against Hugging Face transformers end to end, and what its features
  cost (``python -m perf.engine.bench_e2e``).
* ``serving/``: through an OpenAI server, paged-serve's against llama.cpp's, and the load test
  (``python -m perf.serving.bench_serving``).
* ``cpu/``: the CPU ops and decode steps against the torch code and HF they replace
  (``python -m perf.cpu.bench_step``).
* ``wall_timing.py``: the wall-clock median the host-side benchmarks share.
"""
