"""A fault while processing one request fails that request alone; a dead loop fails streams."""

from __future__ import annotations

import asyncio

import pytest

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.async_engine import AsyncEngine, EngineDeadError
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([6, 19], seed=2)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral")


def test_a_failing_request_does_not_stop_the_others(model):
    engine = LLMEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model))
    bad = engine.add_request(PROMPTS[0], PARAMS)
    good = engine.add_request(PROMPTS[1], PARAMS)

    def explode(token: int) -> bool:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "boom")

    engine.outputs.live[bad].detokenizer.add_token = explode
    outs: dict[str, list] = {bad: [], good: []}
    while engine.has_unfinished:
        for out in engine.step():
            outs[out.request_id].append(out)
    [failed] = outs[bad]
    assert failed.finished and failed.finish_reason == "error"
    assert "UnicodeDecodeError" in failed.error
    tokens = [t for o in outs[good] for t in o.new_token_ids]
    assert tokens == hf_greedy(model, PROMPTS[1], 8)
    assert outs[good][-1].finish_reason == "length"
    assert_pool_clean(engine.block_manager)


def test_a_dead_engine_loop_ends_streams_with_an_error(model):
    eng = AsyncEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model))

    def crash():
        raise RuntimeError("simulated device failure")

    eng.engine.step = crash

    async def main():
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in eng.add_request(PROMPTS[0], PARAMS):
                pass

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert not eng.is_alive

    async def refused():
        with pytest.raises(EngineDeadError):
            eng.add_request(PROMPTS[0], PARAMS)

    asyncio.run(refused())
