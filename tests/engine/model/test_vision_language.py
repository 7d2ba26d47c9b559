"""A LLaVA checkpoint with images, against Hugging Face's ``generate`` on the same processor
output in fp32, token for token: one image and two, images of different sizes and aspect ratios,
batched with text-only prompts, through chunked prefill (8 tokens a step: an image's 16
placeholders run over two steps), after preemption, on a prefix-cache hit with the same image
and with none over a different image of the same size; the block pool intact after each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.llm import LLM
from paged_serve.engine.sampling_params import SamplingParams
from tests.vision_models import checkerboard, gradient, llava, noise

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENGINE = {"dtype": "float32", "kv_cache_memory": 8 << 20, "max_num_batched_tokens": 8}
CASES = [
    ("w1 <image> w2 w3", [gradient(60, 40)]),
    ("w4 w5 <image> w6 <image> w7", [checkerboard(30, 90), noise(2, 64, 64)]),
    ("w8 w9 w10", []),
    ("<image> w11", [noise(3, 100, 50)]),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return llava(tmp_path_factory.mktemp("llava") / "llava")


def hf_tokens(model, folder: Path, text: str, images: list, **processor_kwargs) -> list[int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text=text, images=images or None, return_tensors="pt", **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def prompt(llm: LLM, text: str, images: list):
    return llm.engine.multimodal_prompt(text, images) if images else text


def test_images_batched_and_chunked_equal_hf(checkpoint) -> None:
    folder, model = checkpoint
    llm = LLM(str(folder), **ENGINE)
    got = llm.generate([prompt(llm, t, ims) for t, ims in CASES], GREEDY)
    for (text, images), result in zip(CASES, got):
        assert result.token_ids == hf_tokens(model, folder, text, images), text
    assert llm.engine.runner.encoder.encoded == 4  # each image through the encoder once
    assert not llm.engine.runner.encoder.features  # nothing kept once no chunk needs it
    llm.engine.block_manager.check_integrity()


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(checkpoint) -> None:
    folder, model = checkpoint
    llm = LLM(str(folder), **{**ENGINE, "max_num_batched_tokens": 64})
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 <image> w17"
    first, second = noise(7, 56, 56), noise(8, 56, 56)  # same size, different pixels
    sched = llm.engine.scheduler
    llm.generate(prompt(llm, text, [first]), GREEDY)
    hits = sched.prefix_hit_tokens
    again = llm.generate(prompt(llm, text, [first]), GREEDY)[0]
    assert sched.prefix_hit_tokens - hits == 32  # the text's block and the image's block
    assert again.token_ids == hf_tokens(model, folder, text, [first])
    hits = sched.prefix_hit_tokens
    other = llm.generate(prompt(llm, text, [second]), GREEDY)[0]
    assert sched.prefix_hit_tokens - hits == 16  # the text's block only
    assert other.token_ids == hf_tokens(model, folder, text, [second])
    assert other.token_ids != again.token_ids
    llm.engine.block_manager.check_integrity()


def test_preempted_requests_with_images_equal_hf(checkpoint) -> None:
    """Four requests growing to 2-3 blocks each in a pool of 6: some are preempted and
    recomputed, their images encoded again."""
    folder, model = checkpoint
    block = 2 * 2 * 16 * 2 * 16 * 4  # layers x sides x block x KV heads x head dim x fp32
    llm = LLM(str(folder), **{**ENGINE, "kv_cache_memory": 6 * block, "max_num_batched_tokens": 32})
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cases = CASES[:2] + CASES[3:] + [("w12 <image>", [gradient(56, 56)])]
    got = llm.generate([prompt(llm, t, ims) for t, ims in cases], params)
    assert llm.engine.scheduler.num_preemptions > 0
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    for (text, images), result in zip(cases, got):
        inputs = processor(text=text, images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert result.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist(), text
    llm.engine.block_manager.check_integrity()


def test_text_only_prompts_equal_hf(checkpoint) -> None:
    folder, model = checkpoint
    llm = LLM(str(folder), **ENGINE)
    prompts = [[7, 8, 9], list(range(10, 40)), [12]]
    for p, result in zip(prompts, llm.generate(prompts, GREEDY)):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8)
        assert result.token_ids == out[0, len(p) :].tolist()


def test_images_are_refused_where_they_cannot_be_served(checkpoint, tmp_path: Path) -> None:
    folder, _ = checkpoint
    llm = LLM(str(folder), **ENGINE)
    with pytest.raises(ValueError, match="<image> tokens"):
        llm.engine.multimodal_prompt("w1 w2", [noise(1, 56, 56)])  # no marker for the image
    with pytest.raises(ValueError, match="tensor parallelism does not shard"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=2)
    from tests.conftest import tiny_model

    text_model = tmp_path / "llama"
    tiny_model("llama").save_pretrained(text_model)
    text_only = LLM(str(text_model), **ENGINE)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_only.engine.multimodal_prompt("w1 <image>", [noise(1, 56, 56)])


def test_samples_of_a_prompt_with_an_image_share_its_blocks(checkpoint) -> None:
    """n = 2: the prompt (its image) prefilled once, both samples greedy: HF's tokens."""
    folder, model = checkpoint
    llm = LLM(str(folder), **ENGINE)
    text, images = CASES[0]
    params = SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate(prompt(llm, text, images), params)
    want = hf_tokens(model, folder, text, images)
    assert [r.token_ids for r in got] == [want, want]
    assert llm.engine.runner.encoder.encoded == 1
    llm.engine.block_manager.check_integrity()


def test_async_engine_carries_the_images_to_the_engine_thread(checkpoint) -> None:
    """AsyncEngine.add_request with a MultimodalPrompt: the engine thread gets its images
    (not only its token ids), so the reply equals HF's; image_marker is the processor's."""
    import asyncio

    from paged_serve.engine.async_engine import AsyncEngine
    from paged_serve.engine.config import EngineConfig

    folder, model = checkpoint
    engine = AsyncEngine(EngineConfig(model=str(folder), **ENGINE))
    text, images = CASES[1]

    async def run() -> list[int]:
        ids: list[int] = []
        async for out in engine.add_request(engine.multimodal_prompt(text, images), GREEDY):
            ids += out.new_token_ids
        return ids

    try:
        assert engine.image_marker == "<image>"
        assert asyncio.run(run()) == hf_tokens(model, folder, text, images)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_processor_kwargs_reach_the_processor(checkpoint) -> None:
    """``--mm-processor-kwargs`` go to the processor's call as they are: unnormalised pixels
    (``do_normalize`` false) are other pixel inputs, and the tokens are HF's over the same
    processor output; a value the processor cannot take is a ValueError naming the flag."""
    folder, model = checkpoint
    text, images = CASES[0]
    plain = LLM(str(folder), **ENGINE).engine.multimodal_prompt(text, images)
    raw = LLM(str(folder), mm_processor_kwargs={"do_normalize": False}, **ENGINE)
    prompt = raw.engine.multimodal_prompt(text, images)
    assert prompt.token_ids == plain.token_ids
    pixels = [p.images[0].pixel_inputs["pixel_values"] for p in (plain, prompt)]
    assert not torch.equal(*pixels)
    [got] = raw.generate([prompt], GREEDY)
    assert got.token_ids == hf_tokens(model, folder, text, images, do_normalize=False)
    bad = LLM(str(folder), mm_processor_kwargs={"size": "large"}, **ENGINE)
    with pytest.raises(ValueError, match="mm-processor-kwargs"):
        bad.engine.multimodal_prompt(text, images)


def test_the_dashboard_state_shows_image_tokens_and_their_blocks(checkpoint) -> None:
    """Two images of 16 placeholders each (positions 2-17 and 19-34), blocks of 16: they lie in
    the request's blocks 0, 1 and 2; a text request has none."""
    from paged_serve.engine.observe.engine_state import take_state

    folder, _ = checkpoint
    llm = LLM(str(folder), **{**ENGINE, "max_num_batched_tokens": 256})
    text, images = CASES[1]
    prompt = llm.engine.multimodal_prompt(text, images)
    assert [(i.offset, i.length) for i in prompt.images] == [(2, 16), (19, 16)]
    llm.engine.add_request(prompt, GREEDY)
    llm.engine.add_request("w8 w9 w10", GREEDY)
    llm.engine.step()
    state = take_state(llm.engine, None)
    with_images, text_only = state.running
    assert with_images.image_tokens == 32
    assert with_images.image_blocks == with_images.blocks[:3]
    assert (text_only.image_tokens, text_only.image_blocks) == (0, [])
