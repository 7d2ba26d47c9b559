"""A conversation's image parts (chat completions' and Responses'): found, counted, loaded and
decoded before anything reaches the engine, and replaced in the messages by the model's image
marker text (LLaVA's ``<image>``), so the chat template renders one marker per image where the
image was.

Chat's ``image_url`` parts (``{"url", "detail"}``) and Responses' ``input_image`` parts (a URL
string) are images; text parts stay; any other part (``input_audio``, ``video_url``,
``image_embeds``, ...) is a 400 naming its type. A model that takes no images answers an image
with a 400 naming the model.

Chat templates take a message's content in one of two shapes, as vLLM tells apart: a string
(the marker inside the text), or, for a template that loops over ``message['content']`` (the
llava-hf processors' templates: ``{% for c in message['content'] | selectattr('type',
'equalto', 'image') %}<image>...``), a list of ``{"type": "text", "text"}`` and ``{"type":
"image"}`` parts, where the template writes the marker itself. ``as_template_parts`` gives a
conversation with images the second shape when its template loops over content.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from paged_serve.server.media.config import MediaConfig
from paged_serve.server.media.decode import DECODE_POOL, decode_image
from paged_serve.server.media.sources import image_bytes
from paged_serve.server.protocol.common import ContentPart, ImageURL
from paged_serve.server.protocol.errors import bad_request

TEXT_PARTS = {"text", "input_text", "output_text"}
IMAGE_PARTS = {"image_url", "input_image"}


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image of a request: its URL and the field it came from (``messages[0].content[1]``)."""

    url: str
    param: str


def image_parts(messages: Sequence[msgspec.Struct], params: Sequence[str]) -> list[ImagePart]:
    """The image parts of ``messages`` (each with a ``content``), in order; ``params[i]`` names
    message ``i``. 400 for a part that is neither text nor an image, or an image without a URL."""
    found = []
    for message, param in zip(messages, params, strict=True):
        content = getattr(message, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"{param}.content[{j}]"
            if part.type in TEXT_PARTS:
                continue
            if part.type not in IMAGE_PARTS:
                raise bad_request(
                    f"content part type {part.type!r} is not supported (text and image parts only)",
                    where,
                )
            url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
            if not url:
                raise bad_request(f"a {part.type} part needs its image URL", where)
            found.append(ImagePart(url, where))
    return found


def check_images(
    images: Sequence[ImagePart], marker: str | None, model: str, config: MediaConfig
) -> str:
    """The image marker, once ``images`` pass: 400 for a model that takes no images
    (``marker`` None) or more images than ``config.max_images``."""
    if marker is None:
        raise bad_request(f"the model {model!r} takes no images", images[0].param)
    if len(images) > config.max_images:
        raise bad_request(
            f"the request has {len(images)} images; at most {config.max_images} are taken per "
            "prompt (--limit-mm-per-prompt)",
            images[config.max_images].param,
        )
    return marker


def with_markers(messages: Sequence[msgspec.Struct], marker: str) -> list[msgspec.Struct]:
    """``messages`` with each image part replaced by a text part holding ``marker``."""
    out = []
    for message in messages:
        content = getattr(message, "content", None)
        if isinstance(content, list) and any(p.type in IMAGE_PARTS for p in content):
            parts = [
                ContentPart(type="text", text=marker) if p.type in IMAGE_PARTS else p
                for p in content
            ]
            message = msgspec.structs.replace(message, content=parts)
        out.append(message)
    return out


@dataclass(frozen=True, slots=True)
class ConversationImages:
    """A conversation ready for the chat template: its messages (image parts as ``marker``
    text parts) and its decoded images in order; no images and ``marker`` "" without any."""

    messages: list[msgspec.Struct]
    images: list[object]
    marker: str


async def conversation_images(
    messages: Sequence[msgspec.Struct],
    params: Sequence[str],
    *,
    marker: str | None,
    model: str,
    config: MediaConfig,
) -> ConversationImages:
    """``messages``' images checked (``image_parts``, ``check_images``), loaded and decoded,
    and their parts replaced by ``marker`` (the model's, None when it takes no images)."""
    found = image_parts(messages, params)
    if not found:
        return ConversationImages(list(messages), [], "")
    marker = check_images(found, marker, model, config)
    decoded = await load_images(found, config)
    return ConversationImages(with_markers(messages, marker), decoded, marker)


async def load_images(images: Sequence[ImagePart], config: MediaConfig) -> list[object]:
    """Every image fetched and decoded (RGB PIL images, in order); the first failure is the
    400, and the others are awaited before it goes out (none is left running)."""
    loop = asyncio.get_running_loop()

    async def load(image: ImagePart) -> object:
        data = await image_bytes(image.url, config, image.param)
        return await loop.run_in_executor(
            DECODE_POOL,
            lambda: decode_image(data, max_pixels=config.max_pixels, param=image.param),
        )

    results = await asyncio.gather(*(load(i) for i in images), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


# ``{% for x in message['content'] ...`` or ``{% for x in message.content ...``
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content\b)"
)


def loops_over_content(template: str) -> bool:
    """Whether a chat template reads a message's content as a list of parts."""
    return _LOOPS_OVER_CONTENT.search(template) is not None


def as_template_parts(messages: list[dict], marker: str) -> list[dict]:
    """Template messages with string content as OpenAI-style parts: each ``marker`` an
    ``{"type": "image"}`` part, the text around it ``{"type": "text"}`` parts (newlines the
    markers were joined with dropped)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts: list[dict] = []
            for i, text in enumerate(content.split(marker)):
                if i:
                    parts.append({"type": "image"})
                if text.strip("\n"):
                    parts.append({"type": "text", "text": text.strip("\n")})
            message = {**message, "content": parts}
        out.append(message)
    return out
