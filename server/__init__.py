"""paged-serve's OpenAI-compatible aiohttp server (talks to the engine's async API only)."""

import engine

__paged_serve__ = True

# An ``engine`` package from another distribution would fail here, before any route imports it
# (engine/__init__.py explains the check).
if getattr(engine, "__paged_serve__", False) is not True:
    raise ImportError(
        f"the 'engine' package imported from {getattr(engine, '__file__', None)} is not "
        "paged-serve's: install paged-serve in its own virtual environment"
    )
