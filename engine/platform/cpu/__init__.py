"""CPU-only code: decode attention over the paged cache, the CPU projections (fp32 column split,
oneDNN bf16), keeping freed host memory, one OpenMP pool.
"""
