"""Tests of kernels/ under Triton's interpreter against kernels/reference.py (conftest.py: the
interpreter switch, the device fixture, the paged-KV builder, the GPU-order reductions)."""
