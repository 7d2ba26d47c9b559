"""The asyncio-facing engine: streaming deltas, aborts free blocks, errors before streaming."""

from __future__ import annotations

import asyncio

import pytest

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.async_engine import AsyncEngine, QueueFullError
from tests.conftest import hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([4, 20, 33], seed=7)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture
def engine(model):
    eng = AsyncEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model))
    yield eng
    eng.shutdown()
    assert not eng._thread.is_alive()


async def collect(eng: AsyncEngine, prompt, params, stop_after: int | None = None):
    tokens, outs = [], []
    async for out in eng.add_request(prompt, params):
        tokens += out.new_token_ids
        outs.append(out)
        if stop_after is not None and len(tokens) >= stop_after:
            break
    return tokens, outs


def test_concurrent_streams_match_hf(engine, model):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))

    results = asyncio.run(main())
    for prompt, (tokens, outs) in zip(PROMPTS, results):
        assert tokens == hf_greedy(model, prompt, 10)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].metrics.num_output_tokens == 10
    engine.check_integrity()
    assert engine.snapshot().kv_blocks_used == 0


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        tokens, _ = await collect(engine, PROMPTS[1], params, stop_after=3)
        for _ in range(200):  # the abort lands within a step
            if engine.snapshot().kv_blocks_used == 0 and engine.snapshot().num_running == 0:
                break
            await asyncio.sleep(0.01)
        return tokens

    assert len(asyncio.run(main())) == 3
    engine.check_integrity()
    assert engine.snapshot().kv_blocks_used == 0


def test_cancelled_task_aborts(engine):
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)

    async def main():
        task = asyncio.create_task(collect(engine, PROMPTS[2], params))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if engine.snapshot().num_running == 0 and engine.snapshot().kv_blocks_used == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    engine.check_integrity()
    assert engine.snapshot().kv_blocks_used == 0


def test_bad_requests_raise_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            engine.add_request([], SamplingParams())
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request([10**9], SamplingParams())

    asyncio.run(main())
    assert engine.is_alive


def test_full_waiting_queue_is_refused(model):
    eng = AsyncEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model), max_waiting=0)
    try:

        async def main():
            with pytest.raises(QueueFullError):
                eng.add_request(PROMPTS[0], SamplingParams())

        asyncio.run(main())
    finally:
        eng.shutdown()
