"""CPU benchmarks: the engine's CPU ops against the torch code they replace, and whole decode
steps of CPU-run model families against Hugging Face on the same random weights.

* ops: ``bench_attention.py`` (the C decode-attention kernel against the gather and SDPA),
  ``bench_linears.py`` (the few-row fp32 projection kernels against ``F.linear``),
  ``bench_sampling.py`` (the eager draw against ``reference.sample_ref``).
* steps: ``bench_step.py`` (where a decode step's time goes, per engine mode), ``bench_moe.py``
  (mixture of experts; its step helpers are shared by the next two), ``bench_mla.py``
  (DeepSeek-V3's latent attention), ``bench_hybrid.py`` (Qwen3-Next's linear attention).

Every file is a command-line program (``python -m perf.cpu.bench_step``); none is collected by
``pytest perf/``.
"""
