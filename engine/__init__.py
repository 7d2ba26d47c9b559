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

# The public names load on first use (PEP 562), so importing one light module of the engine
# (the grammar probe process imports engine.grammar.structured_output) does not load the model
# stack.
_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionResult": "engine.outputs",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
