"""Triton kernels of paged-serve and their eager PyTorch references.

One kernel family per module; `reference.py` holds the fp32 eager references that the tests, the
benchmarks and the engine's `torch` backend share. This package imports nothing from the project.
"""

__paged_serve__ = True  # the engine checks it: see engine/__init__.py
