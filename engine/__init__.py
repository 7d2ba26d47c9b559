"""paged-serve's engine (``paged_serve.engine``): requests, block manager, scheduler, model
runner and the offline API.

The offline API's names load on first use (PEP 562), so importing one light module of the engine
(the grammar probe process imports ``paged_serve.engine.grammar.structured_output``) does not
load the model stack.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "paged_serve.engine.llm",
    "CompletionResult": "paged_serve.engine.outputs",
    "EngineConfig": "paged_serve.engine.config",
    "PoolingParams": "paged_serve.engine.pooling_params",
    "RequestOutput": "paged_serve.engine.outputs",
    "SamplingParams": "paged_serve.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paged_serve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
