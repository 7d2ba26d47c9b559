"""Benchmarks: block-manager fragmentation, end to end throughput, GPU microbenchmarks."""
