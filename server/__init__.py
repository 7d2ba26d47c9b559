"""paged-serve's OpenAI-compatible aiohttp server (talks to the engine's async API only)."""
