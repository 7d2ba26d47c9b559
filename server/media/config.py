"""``MediaConfig``: the limits on a request's images, set by vLLM's flags
(``--allowed-local-media-path``, ``--allowed-media-domains``, ``--limit-mm-per-prompt``) and
the server's own bounds on bytes, fetch time and pixels."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_IMAGES = 8


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """``local_path``: the folder ``file://`` URLs may read under (None: no file URLs);
    ``domains``: the hosts ``http(s)://`` URLs may fetch from (empty: no fetching);
    ``max_images``: images per prompt; ``max_bytes``: an image's encoded size;
    ``fetch_timeout_s``: a whole fetch, redirects included; ``max_pixels``: width x height,
    checked from the header before any pixel is decoded (a decompression bomb's guard)."""

    local_path: Path | None = None
    domains: tuple[str, ...] = ()
    max_images: int = DEFAULT_MAX_IMAGES
    max_bytes: int = 20 << 20
    fetch_timeout_s: float = 10.0
    max_pixels: int = 8192 * 8192
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"the image limit must be >= 0, got {self.max_images}")
        if self.max_bytes <= 0 or self.max_pixels <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError(
                "max_bytes, max_pixels and fetch_timeout_s must be positive, got "
                f"{self.max_bytes}, {self.max_pixels}, {self.fetch_timeout_s}"
            )


def image_limit(value: str) -> int:
    """The image count of vLLM's ``--limit-mm-per-prompt`` JSON (``{"image": 4}``); other
    modalities may only be 0 (this server takes no audio or video)."""
    try:
        limits = json.loads(value)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt must be JSON, got {value!r}") from None
    if not isinstance(limits, dict):
        raise ValueError(f'--limit-mm-per-prompt must be an object like {{"image": 4}}: {value!r}')
    for name, count in limits.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {name!r} must be a count >= 0, got {count!r}")
        if name != "image" and count:
            raise ValueError(f"--limit-mm-per-prompt: this server takes no {name} inputs")
    return limits.get("image", DEFAULT_MAX_IMAGES)
