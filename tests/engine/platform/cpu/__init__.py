"""Tests of engine/platform/cpu/: CPU attention and its C decode kernel, linear attention, the
projections' kernels, malloc and OpenMP settings.
"""
