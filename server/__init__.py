"""paged-serve's OpenAI-compatible aiohttp server (``paged_serve.server``): it talks to the
engine through its async API only."""
