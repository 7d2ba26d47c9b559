"""The input embeddings of a step that runs image placeholders: the vision encoder's rows put
in their places, the encoder run once per image.

::

    step's chunks ──► images whose placeholders fall in a chunk ──► encoder cache (by content
    hash) or get_image_features for the missing ones ──► embed_tokens(input_ids) with each
    placeholder row replaced by its image's row

A chunk may cut an image: its rows are the image's rows for the positions the chunk holds, so
the next chunk takes the rest from the cache. An image stays cached while a chunk of the step
stopped inside its placeholders (the next chunk needs it); the others are dropped after the step
(a prefix-cache hit serves the same image's KV without its encoder output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from paged_serve.engine.multimodal_inputs import ImageInput
from paged_serve.engine.sched.batch import ScheduledBatch

StepImages = tuple[list["ImageRows"], ScheduledBatch]  # a step's rows and the batch holding them


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Flat rows ``[row, row + count)`` of the step take rows ``[first, first + count)`` of
    ``image``'s encoder output."""

    image: ImageInput
    row: int
    first: int
    count: int


def image_rows(batch: ScheduledBatch) -> list[ImageRows]:
    """Where the step's chunks hold image placeholders (none for text-only steps)."""
    rows: list[ImageRows] = []
    flat = 0
    for sched in batch.requests:
        for image in sched.request.images:
            lo, hi = max(sched.start, image.offset), min(sched.end, image.end)
            if lo < hi:
                rows.append(ImageRows(image, flat + lo - sched.start, lo - image.offset, hi - lo))
        flat += sched.num_new_tokens
    return rows


def image_features(model: PreTrainedModel, image: ImageInput) -> torch.Tensor:
    """``image``'s encoder output ``[length, hidden]`` through the model's own
    ``get_image_features`` (its vision tower and projector)."""
    out = model.get_image_features(**image.pixel_inputs)
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    features = features.reshape(-1, features.shape[-1])
    if features.shape[0] != image.length:
        raise ValueError(
            f"the vision encoder gave {features.shape[0]} rows for an image of "
            f"{image.length} placeholders"
        )
    return features


class EncoderCache:
    """Each image's encoder output by content hash, for the steps that need it."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.features: dict[str, torch.Tensor] = {}
        self.encoded = 0  # images run through the encoder (a cached one is not counted)

    def step(self, batch: ScheduledBatch) -> StepImages | None:
        """The step's image placeholder rows with its batch; None for a step without any
        (the cache then keeps nothing)."""
        rows = image_rows(batch)
        if not rows:
            self.features.clear()
            return None
        return rows, batch

    def embeddings(
        self, input_ids: torch.Tensor, rows: list[ImageRows], batch: ScheduledBatch
    ) -> torch.Tensor:
        """``input_ids [T]`` embedded, the ``rows`` taken from their images' encoder outputs;
        ``[T, hidden]``. Keeps, after it, only the images a chunk of ``batch`` stopped in."""
        embeds = self.model.get_input_embeddings()(input_ids)
        for part in rows:
            features = self.features.get(part.image.content_hash)
            if features is None:
                features = image_features(self.model, part.image).to(embeds.dtype)
                self.features[part.image.content_hash] = features
                self.encoded += 1
            embeds[part.row : part.row + part.count] = features[
                part.first : part.first + part.count
            ]
        self._keep(batch)
        return embeds

    def _keep(self, batch: ScheduledBatch) -> None:
        needed = {
            image.content_hash
            for sched in batch.requests
            for image in sched.request.images
            if image.offset < sched.end < image.end
        }
        self.features = {h: f for h, f in self.features.items() if h in needed}
