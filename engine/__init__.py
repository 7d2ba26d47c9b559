"""paged-serve's engine: requests, block manager, scheduler, model runner and the offline API.

``engine``, ``kernels`` and ``server`` are generic top-level names that another installed
distribution could also provide (pip would then mix the two in site-packages). Each of our
packages carries ``__paged_serve__``; importing one checks that its siblings carry it too, so a
foreign package fails loudly at import instead of misbehaving later.
"""

import importlib
import types

__paged_serve__ = True


def require_paged_serve_package(name: str) -> types.ModuleType:
    """Import the top-level package ``name`` and raise ImportError unless it is paged-serve's."""
    module = importlib.import_module(name)
    if getattr(module, "__paged_serve__", False) is not True:
        raise ImportError(
            f"the {name!r} package imported from {getattr(module, '__file__', None)} is not "
            f"paged-serve's: another installed distribution provides a top-level {name!r} "
            "package. Install paged-serve in its own virtual environment."
        )
    return module


require_paged_serve_package("kernels")

from engine.config import EngineConfig  # noqa: E402  (after the check)
from engine.llm import LLM  # noqa: E402
from engine.outputs import CompletionResult, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionResult", "EngineConfig", "RequestOutput", "SamplingParams"]
