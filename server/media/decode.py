"""Encoded image bytes to an RGB PIL image, in ``DECODE_POOL``: the header is read first and an
image of more than ``max_pixels`` pixels is refused before its pixels are decoded (a 50k x 50k
PNG is a few hundred bytes and 7.5 GB decoded); then ``load()`` decodes it whole, so a truncated
file fails here, not in the engine, and it is converted to RGB.

Pillow is imported here, lazily: only a request with an image needs it, and a server without
it answers such a request with a 500 that says so instead of failing to start.
"""

from __future__ import annotations

import io
import warnings
from concurrent.futures import ThreadPoolExecutor

from paged_serve.server.protocol.errors import SERVER_ERROR, APIError, bad_request

# Decoding is CPU work that releases the GIL in Pillow's codecs; two workers on a 2-core box
# keep one request's images from waiting on another's while leaving the engine a core.
DECODE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="media")


def _pillow():  # noqa: ANN202 - the PIL.Image module
    try:
        from PIL import Image
    except ImportError:
        raise APIError(
            500,
            "image inputs need Pillow, which this server lacks (pip install pillow)",
            type=SERVER_ERROR,
        ) from None
    return Image


def decode_image(data: bytes, *, max_pixels: int, param: str) -> object:
    """``data`` (PNG, JPEG, ... any format Pillow reads) as an RGB ``PIL.Image.Image``; 400
    naming ``param`` for bytes that are no image, a truncated one, or one over ``max_pixels``."""
    image_module = _pillow()
    try:
        with warnings.catch_warnings():
            # our own pixel budget decides; Pillow's warning (and its error at twice its
            # MAX_IMAGE_PIXELS) fire on the header, before any pixel is decoded, too
            warnings.simplefilter("ignore", image_module.DecompressionBombWarning)
            image = image_module.open(io.BytesIO(data))
    except image_module.DecompressionBombError:
        raise bad_request(f"the image is larger than {max_pixels} pixels", param) from None
    except (OSError, ValueError, SyntaxError) as exc:  # UnidentifiedImageError is an OSError
        raise bad_request(f"the image does not decode: {exc}", param) from None
    width, height = image.size
    if width * height > max_pixels:
        raise bad_request(
            f"the image is {width}x{height} = {width * height} pixels; at most {max_pixels} "
            "are taken",
            param,
        )
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise bad_request(f"the image does not decode: {exc}", param) from None
