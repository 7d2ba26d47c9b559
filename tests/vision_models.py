"""A tiny random-weight LLaVA checkpoint written to a folder with its processor (a CLIP image
processor and a word-level tokenizer with ``<image>``), and images made with numpy and Pillow:
what the vision-language tests load by path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from perf.engine.pooling_models import word_tokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<eos>", "<image>"] + [f"w{i}" for i in range(122)]
IMAGE_TOKEN = 5
IMAGE_SIZE = 56  # 4 x 4 patches of 14: 16 placeholders an image


def llava(folder: Path, seed: int = 0) -> tuple[Path, LlavaForConditionalGeneration]:
    """A 2-layer Llama behind a 2-layer CLIP vision tower (LLaVA-1.5's shape), saved with its
    processor; returns the folder and the model (the reference)."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(
        LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    ).eval()
    model.save_pretrained(folder)
    tokenizer = word_tokenizer(WORDS, encoder=False)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    ).save_pretrained(folder)
    return folder, model


def noise(seed: int, width: int, height: int) -> Image.Image:
    """An RGB image of seeded noise."""
    pixels = np.random.RandomState(seed).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def gradient(width: int, height: int) -> Image.Image:
    """A horizontal red and vertical green gradient."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, 128)], -1).astype("uint8"))


def checkerboard(width: int, height: int, square: int = 8) -> Image.Image:
    """Black and white squares of ``square`` pixels."""
    cells = (np.arange(height)[:, None] // square + np.arange(width)[None, :] // square) % 2
    return Image.fromarray((cells[..., None].repeat(3, -1) * 255).astype("uint8"))
