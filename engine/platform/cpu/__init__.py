"""CPU-only code: decode attention over the paged cache, the CPU projections (fp32's few-row
kernel chosen at load, oneDNN packed weights), keeping freed host memory, one OpenMP pool.
"""
