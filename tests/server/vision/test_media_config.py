"""The image flags (vLLM's ``--limit-mm-per-prompt`` JSON, the two allow-lists) into
``MediaConfig``, and the refusal of every image part on a model without a vision encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_serve.server.cli import build_parser, media_from_args
from paged_serve.server.media.config import DEFAULT_MAX_IMAGES, MediaConfig, image_limit
from paged_serve.server.media.images import ImagePart, check_images
from paged_serve.server.protocol.errors import APIError


def test_flags_into_media_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--allowed-local-media-path",
            str(tmp_path),
            "--allowed-media-domains",
            "a.example",
            "b.example",
            "--limit-mm-per-prompt",
            '{"image": 2, "video": 0}',
        ]
    )
    assert media_from_args(args) == MediaConfig(
        local_path=tmp_path, domains=("a.example", "b.example"), max_images=2
    )
    assert media_from_args(build_parser().parse_args([])) == MediaConfig()


@pytest.mark.parametrize("value", ["[1]", '{"image": -1}', '{"audio": 1}', "{", '{"image": true}'])
def test_bad_limits_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        image_limit(value)


def test_the_default_limit() -> None:
    assert image_limit("{}") == DEFAULT_MAX_IMAGES == 8


def test_a_model_without_images_refuses_them_by_name() -> None:
    images = [ImagePart("data:image/png;base64,", "messages[0].content[0]")]
    with pytest.raises(APIError) as raised:
        check_images(images, None, "tiny-text", MediaConfig())
    assert raised.value.status == 400
    assert "'tiny-text' takes no images" in str(raised.value)
