"""paged-serve: a paged-attention LLM serving engine on its own Triton kernels.

This file is the ``paged_serve`` package itself, the distribution's one import name. Its
subpackages are the repository's top-level folders, mapped by ``pyproject.toml``'s
``package-dir``: ``paged_serve.engine`` is ``engine/``, ``paged_serve.kernels`` is ``kernels/``
and ``paged_serve.server`` is ``server/`` (docs/architecture.md, "One import name").

``from paged_serve import LLM, SamplingParams`` is the offline API (the names
``paged_serve.engine`` exports, loaded on first use), so ``import paged_serve.kernels`` loads no
engine.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path

__all__ = [
    "CompletionResult",
    "EngineConfig",
    "LLM",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]

try:
    __version__ = metadata.version("paged-serve")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"


# In a wheel the subpackages sit beside this file. In a checkout (an editable install, or the
# source tree on sys.path through a link to this folder, as ci/gpu-check.sh does) they are the
# repository's top-level folders, so the repository joins the package's search path. kernels/
# has no __init__.py (it must never hide Hugging Face's `kernels` when the repository itself is
# on sys.path), and setuptools' editable finder cannot map such a folder; this search can.
_CHECKOUT = Path(__file__).resolve().parents[2]
_IN_WHEEL = (Path(__file__).parent / "engine").is_dir()
if not _IN_WHEEL and (_CHECKOUT / "engine" / "paged_serve").is_dir():
    __path__.append(str(_CHECKOUT))


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'paged_serve' has no attribute {name!r}")
    return getattr(importlib.import_module("paged_serve.engine"), name)
