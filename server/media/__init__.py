"""Image inputs of the generation endpoints: where a request's images may come from (``data:``
URLs always, ``file://`` under ``--allowed-local-media-path``, ``http(s)://`` from
``--allowed-media-domains``), how many a prompt may hold, and their decoding with Pillow in a
worker pool (never on the event loop, never in the engine thread)."""
