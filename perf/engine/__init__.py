"""Engine benchmarks: paged-serve's engine (no HTTP server) against Hugging Face transformers,
and what its features cost.

* ``bench_e2e.py``: end-to-end throughput against HF's padded ``generate`` and its continuous
  batching, on one synthetic workload; its parts are ``e2e_workload.py`` (the requests, a
  system's result, greedy agreement), ``hf_baselines.py`` (the HF systems) and
  ``model_shapes.py`` (random-weight models in a real model's shapes, for a GPU machine that
  cannot download).
* ``bench_agreement.py``: how often batched greedy decoding agrees with HF alone.
* features: ``bench_prefix.py`` (prefix caching, n > 1), ``bench_structured.py`` (grammar
  masks), ``bench_logit_adjustments.py`` (penalties and logit bias), ``bench_tp.py`` (tensor
  parallelism's collectives), ``bench_shard_load.py`` (host memory of a sharded load),
  ``bench_engine_state.py`` (the dashboard's state snapshot), ``bench_block_manager.py`` (paged
  KV memory against a contiguous cache).

Every file is a command-line program or its part (``python -m perf.engine.bench_e2e``); none is
collected by ``pytest perf/``.
"""
