"""The HTTP layer: reading a request body once (``bodies``), encoding replies (``wire``),
failures as responses (``errors``), server-sent events (``sse``), and what keeps the server
standing before any handler runs: the connection guard and its timeouts (``connections``), the
limits (``limits``) and the browser guard (``browser_guard``)."""
