"""The kernels of paged-serve: Triton (``kernels/triton/``), the CPU's C decode kernel
(``kernels/cpu/``), the calls every backend implements (``interface.py``) and the fp32 eager
references that define their semantics (``reference.py``: the tests' and benchmarks' oracle;
the engine's `torch` backend also runs its KV write, block copy and sampling). This package
imports nothing from the project.
"""

__paged_serve__ = True  # the engine checks it: see engine/__init__.py
