"""A text prompt and its images to a ``MultimodalPrompt``, through the model's own Hugging Face
processor: it expands each image marker of the text (LLaVA's ``<image>``) into the image's
placeholder tokens and turns each image into the tensors its vision encoder takes.

Each image's placeholder span is found in the expanded ids: one run of the image token per
image, in order (images next to each other share a run, which is cut in equal parts: every image
of such a model expands to the same count). Each tensor the processor returns with one row per
image is cut into the images' own; a processor whose tensors are laid out otherwise (Qwen-VL's
flattened patches) is refused. The content hash is over those tensors, so an image resized or
normalized differently is a different image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from paged_serve.engine.multimodal_inputs import ImageInput, MultimodalPrompt

# what a processor returns beside the images' own tensors
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) of an image's processed tensors, by name."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def placeholder_spans(ids: Sequence[int], image_token_id: int, count: int) -> list[tuple[int, int]]:
    """``count`` spans ``(offset, length)`` of the image token in ``ids``, in order."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) == count:
        return runs
    total = sum(length for _, length in runs)
    if not runs or total % count:
        raise ValueError(
            f"the prompt expands to {total} image placeholders in {len(runs)} runs for "
            f"{count} images: each image needs its marker in the text"
        )
    each = total // count
    spans = []
    for offset, length in runs:
        if length % each:
            raise ValueError("adjacent images of different sizes: separate them with text")
        spans += [(offset + k * each, each) for k in range(length // each)]
    return spans


def multimodal_prompt(
    processor: object,
    config: object,
    text: str,
    images: Sequence[object],
    processor_kwargs: dict[str, object] | None = None,
) -> MultimodalPrompt:
    """``text`` (with one image marker per image) and ``images`` (PIL images) through
    ``processor`` with ``processor_kwargs`` (``--mm-processor-kwargs``, passed to its call as
    they are), for a model of ``config`` (its ``image_token_id``); ValueError when they do not
    fit together or the processor refuses the keyword arguments."""
    kwargs = processor_kwargs or {}
    try:
        out = processor(text=text, images=list(images), return_tensors="pt", **kwargs)
    except Exception as exc:  # a processor's checks raise their own kinds (huggingface_hub's)
        if not kwargs or isinstance(exc, MemoryError):
            raise
        raise ValueError(f"the processor refused --mm-processor-kwargs {kwargs}: {exc}") from exc
    ids = out["input_ids"][0].tolist()
    token = getattr(config, "image_token_id", None)
    token = token if token is not None else config.image_token_index
    spans = placeholder_spans(ids, int(token), len(images))
    pixel_keys = [k for k in out.keys() if k not in TEXT_KEYS]
    for key in pixel_keys:
        if not isinstance(out[key], torch.Tensor) or out[key].shape[0] != len(images):
            raise ValueError(
                f"the processor's {key} does not hold one row per image: images for this model "
                "are not served yet"
            )
    inputs = []
    for i, (offset, length) in enumerate(spans):
        tensors = {key: out[key][i : i + 1] for key in pixel_keys}
        inputs.append(ImageInput(content_hash(tensors), offset, length, tensors))
    return MultimodalPrompt(ids, tuple(inputs))
