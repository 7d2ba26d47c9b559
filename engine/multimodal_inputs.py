"""A prompt with images: its token ids, each image's placeholder span and the processor's
tensors the model's vision encoder takes, as the engine queues it.

The Hugging Face processor expands each image of a prompt into its placeholder tokens (their
count fixes the prompt's length, so the block budget is known before admission). The runner
swaps each placeholder's embedding for the vision encoder's output row
(``engine/runner/image_embeddings.py``). For the prefix cache a placeholder is not its token id
(every image has the same one) but a key of its image's content: ``cache_key_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: ``content_hash`` (hex, of the processor's tensors), the prompt
    positions ``[offset, offset + length)`` of its placeholders, and ``pixel_inputs``: the
    processor's tensors for this image alone (batch dimension 1), as the model's
    ``get_image_features`` takes them."""

    content_hash: str
    offset: int
    length: int
    pixel_inputs: dict[str, torch.Tensor] = field(repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt's token ids (placeholders expanded) and its images, in prompt order."""

    token_ids: list[int]
    images: tuple[ImageInput, ...]


def cache_key_ids(token_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    """``token_ids`` with each image's placeholders replaced by a negative key of its content
    hash: two prompts share prefix-cache blocks over an image only when it is the same image
    (token ids are never negative, so no key can equal a token)."""
    keys = list(token_ids)
    for image in images:
        key = -1 - int(image.content_hash[:15], 16)
        keys[image.offset : image.end] = [key] * image.length
    return keys


def attach_images(requests: Sequence[object], prompt: MultimodalPrompt) -> None:
    """Give each sample of a request (``engine/sched/request.py``'s ``Request``) the prompt's
    images and prefix-cache keys."""
    keys = cache_key_ids(prompt.token_ids, prompt.images)
    for request in requests:
        request.images = prompt.images
        request.prompt_key_ids = keys
