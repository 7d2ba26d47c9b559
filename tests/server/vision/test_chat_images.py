"""Chat completions with images on the tiny LLaVA: a base64 PNG's greedy reply equals Hugging
Face's ``generate`` over the processor's output for the same rendered text and image, token for
token; two images in one message; a text-only chat on the same model; then every way an image
is refused (bad bytes, too many pixels, too many images, parts of other types, URLs from where
the server may not read), each a 400 OpenAI error object naming the part, and the server still
answering afterwards; ``/tokenize`` with an image, and LangChain sending one."""

from __future__ import annotations

import struct
import zlib

import openai
import pytest
import torch
from transformers import AutoProcessor

from tests.server.conftest import assert_error, http
from tests.server.vision.conftest import MAX_IMAGE_BYTES, Vision, data_url, png
from tests.vision_models import checkerboard, gradient, noise

GREEDY = {"max_tokens": 8, "temperature": 0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def client(vision: Vision) -> openai.OpenAI:
    return openai.OpenAI(base_url=vision.url + "/v1", api_key="none", max_retries=0)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "low"}}


def chat_tokens(vision: Vision, content: list | str) -> list[int]:
    reply = client(vision).chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": content}],
        extra_body=EXTRA,
        **GREEDY,
    )
    return reply.choices[0].model_extra["token_ids"]


def hf_tokens(vision: Vision, text: str, images: list) -> list[int]:
    processor = AutoProcessor.from_pretrained(vision.folder)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = vision.model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_a_base64_image_equals_hf(vision: Vision) -> None:
    image = gradient(60, 40)
    content = [{"type": "text", "text": "w3 w4"}, image_part(data_url(png(image)))]
    # the template joins the parts with a newline and opens the reply with w1
    assert chat_tokens(vision, content) == hf_tokens(vision, "w3 w4\n<image> w1", [image])


def test_two_images_in_one_message_equal_hf(vision: Vision) -> None:
    first, second = checkerboard(30, 90), noise(2, 64, 64)
    content = [
        image_part(data_url(png(first))),
        {"type": "text", "text": "w5"},
        image_part(data_url(png(second))),
    ]
    expected = hf_tokens(vision, "<image>\nw5\n<image> w1", [first, second])
    assert chat_tokens(vision, content) == expected


def test_a_template_over_content_parts_equals_the_processors_rendering(
    parts_template: Vision,
) -> None:
    """A template that loops over content parts (llava-hf's shape) gets text and image parts
    and writes the markers itself: the same text the processor's apply_chat_template renders."""
    first, second = gradient(60, 40), noise(5, 50, 70)
    content = [
        {"type": "text", "text": "w3 w4"},
        image_part(data_url(png(first))),
        image_part(data_url(png(second))),
    ]
    processor = AutoProcessor.from_pretrained(parts_template.folder)
    hf_content = [{"type": "text", "text": "w3 w4"}, {"type": "image"}, {"type": "image"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": hf_content}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<image>\n<image>\nw3 w4 w2"
    assert chat_tokens(parts_template, content) == hf_tokens(parts_template, text, [first, second])


def test_a_text_only_chat_on_the_vision_model(vision: Vision) -> None:
    assert chat_tokens(vision, "w6 w7") == hf_tokens(vision, "w6 w7 w1", [])


def test_an_image_from_an_allowed_host_and_file(vision: Vision) -> None:
    """Fetched over http from an allowed host, and read from under the allowed folder, the
    images equal the same pixels sent inline."""
    inline = chat_tokens(vision, [image_part(data_url(png(noise(8, 48, 32))))])
    assert chat_tokens(vision, [image_part(vision.image_host + "/image.png")]) == inline
    same_host = chat_tokens(vision, [image_part(vision.image_host + "/same-host")])
    assert same_host == inline
    local = chat_tokens(vision, [image_part(data_url(png(noise(7, 40, 40))))])
    assert chat_tokens(vision, [image_part((vision.media_dir / "image.png").as_uri())]) == local


def post_image(vision: Vision, *parts: dict, path: str = "chat/completions") -> object:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}, *parts]}]}
    return http("POST", f"{vision.url}/v1/{path}", json={**body, "max_tokens": 2})


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` RGB pixels and whose data is a few
    bytes: a decompression bomb's shape, refused from the header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


GOOD = png(noise(1, 40, 40))


@pytest.mark.parametrize(
    "url, words",
    [
        (data_url(GOOD[: len(GOOD) // 2]), "does not decode"),  # truncated
        (data_url(b"not an image at all"), "does not decode"),
        (data_url(png_header(50000, 50000)), "pixels"),  # Pillow's own bomb guard
        (data_url(png_header(300, 300)), "at most 40000"),  # the server's pixel budget
        ("data:image/png;base64,iVBOR%%%", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/"),
        ("ftp://127.0.0.1/image.png", "data:, file: or http(s)"),
    ],
)
def test_a_bad_image_is_a_400_naming_the_part(vision: Vision, url: str, words: str) -> None:
    error = assert_error(post_image(vision, image_part(url)), 400, param="messages[0].content[1]")
    assert words in error["message"]


@pytest.mark.parametrize(
    "path, words",
    [
        ("/image.png", "not in --allowed-media-domains"),  # localhost is not 127.0.0.1
        ("/elsewhere", "redirects to another host"),
        ("/big", f"over {MAX_IMAGE_BYTES} bytes"),
        ("/slow", "took over 0.5 s"),
    ],
)
def test_a_fetch_refused_is_a_400(vision: Vision, path: str, words: str) -> None:
    base = vision.image_host
    if path == "/image.png":
        base = base.replace("127.0.0.1", "localhost")
    error = assert_error(
        post_image(vision, image_part(base + path)), 400, param="messages[0].content[1]"
    )
    assert words in error["message"]


def test_a_file_outside_the_allowed_folder_is_a_400(vision: Vision, tmp_path) -> None:
    outside = tmp_path / "image.png"
    outside.write_bytes(GOOD)
    for url in (outside.as_uri(), (vision.media_dir / ".." / outside.name).as_uri()):
        error = assert_error(
            post_image(vision, image_part(url)), 400, param="messages[0].content[1]"
        )
        assert "outside --allowed-local-media-path" in error["message"]


def test_too_many_images_is_a_400(vision: Vision) -> None:
    parts = [image_part(data_url(GOOD))] * 4
    error = assert_error(post_image(vision, *parts), 400, param="messages[0].content[4]")
    assert "at most 3" in error["message"]


@pytest.mark.parametrize("kind", ["input_audio", "video_url", "image_embeds", "file"])
def test_other_parts_are_refused_by_type(vision: Vision, kind: str) -> None:
    error = assert_error(
        post_image(vision, {"type": kind, kind: {}}), 400, param="messages[0].content[1]"
    )
    assert repr(kind) in error["message"]


def responses_text(vision: Vision, **fields: object) -> tuple[str, str]:
    """A greedy 8-token Response's id and output text."""
    reply = client(vision).responses.create(
        model="tiny-llava", max_output_tokens=8, temperature=0, extra_body=EXTRA, **fields
    )
    return reply.id, reply.output_text


def hf_text(vision: Vision, text: str, images: list) -> str:
    tokenizer = AutoProcessor.from_pretrained(vision.folder).tokenizer
    return tokenizer.decode(hf_tokens(vision, text, images), skip_special_tokens=True)


def test_responses_input_image_equals_hf(vision: Vision) -> None:
    image = noise(9, 56, 56)
    parts = [
        {"type": "input_text", "text": "w8"},
        {"type": "input_image", "image_url": data_url(png(image)), "detail": "auto"},
    ]
    response_id, got = responses_text(vision, input=[{"role": "user", "content": parts}])
    assert got.split() == hf_text(vision, "w8\n<image> w1", [image]).split()
    # a follow-up replays the stored conversation, its image included
    _, again = responses_text(vision, input="w9", previous_response_id=response_id)
    expected = hf_text(vision, f"w8\n<image> {got} w9 w1", [image])
    assert again.split() == expected.split()


def test_responses_bad_image_is_a_400(vision: Vision) -> None:
    parts = [{"type": "input_image", "image_url": data_url(GOOD[:50])}]
    body = {"input": [{"role": "user", "content": parts}], "max_output_tokens": 2}
    reply = http("POST", f"{vision.url}/v1/responses", json=body)
    assert "does not decode" in assert_error(reply, 400, param="input[0].content[0]")["message"]


def test_the_server_answers_after_refusals(vision: Vision) -> None:
    for url in (data_url(GOOD[:40]), data_url(png_header(50000, 50000))):
        assert post_image(vision, image_part(url)).status == 400
    assert len(chat_tokens(vision, [image_part(data_url(GOOD))])) == 8


def test_a_marker_typed_in_the_text_is_a_400(vision: Vision) -> None:
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "<image> w1"}, image_part(data_url(GOOD))],
            }
        ],
        "max_tokens": 2,
    }
    reply = http("POST", f"{vision.url}/v1/chat/completions", json=body)
    assert_error(reply, 400, param="messages")


def test_tokenize_counts_an_image_as_its_placeholders(vision: Vision) -> None:
    """``/tokenize`` with an image part: the ids the chat would run (the processor's, the
    image's placeholders expanded), the count chat completions reports; a bad image is the
    same 400 naming the part."""
    image = gradient(60, 40)
    content = [{"type": "text", "text": "w3 w4"}, image_part(data_url(png(image)))]
    messages = [{"role": "user", "content": content}]
    reply = http("POST", f"{vision.url}/tokenize", json={"messages": messages})
    assert reply.status == 200, reply.body
    processor = AutoProcessor.from_pretrained(vision.folder)
    want = processor(text="w3 w4\n<image> w1", images=[image], return_tensors="pt")["input_ids"]
    assert reply.json()["tokens"] == want[0].tolist()
    chat = client(vision).chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=1, temperature=0
    )
    assert reply.json()["count"] == chat.usage.prompt_tokens
    bad = [{"role": "user", "content": [image_part(data_url(GOOD[:40]))]}]
    reply = http("POST", f"{vision.url}/tokenize", json={"messages": bad})
    assert_error(reply, 400, param="messages[0].content[0]")


def test_langchain_sends_an_image_as_its_users_do(vision: Vision) -> None:
    """LangChain's ChatOpenAI with a ``HumanMessage`` of text and an ``image_url`` block (the
    form its docs show): the reply's text is the greedy reply to the same content."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    image = gradient(60, 40)
    content = [{"type": "text", "text": "w3 w4"}, image_part(data_url(png(image)))]
    llm = ChatOpenAI(
        base_url=f"{vision.url}/v1",
        api_key="unused",
        model="tiny-llava",
        temperature=0,
        max_tokens=8,
        max_retries=0,
    )
    answer = llm.invoke([HumanMessage(content=content)])
    direct = client(vision).chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": content}], **GREEDY
    )
    assert answer.content and answer.content == direct.choices[0].message.content
    assert answer.usage_metadata["input_tokens"] == direct.usage.prompt_tokens
