"""Engine-side limits from the second reliability review: n > 1 takes seats, a step's memory
failure or a non-finite row fails requests (never the loop), seeds and penalties are bounded at
the engine API, unseeded draws come from the OS, and a racing ``add_request`` fails fast."""

from __future__ import annotations

import asyncio

import pytest
import torch

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.async_engine import AsyncEngine, EngineDeadError
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sample.sampler import INVALID_TOKEN
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([5, 9, 14], seed=7)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=2 << 20, **config), loaded=loaded(model))


def run(engine: LLMEngine) -> dict[str, list]:
    """Step until idle; every output by request id."""
    outs: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_n_samples_take_seats_so_a_step_never_samples_more_than_max_num_seqs(model):
    engine = make_engine(model, max_num_seqs=4)
    engine.add_request(PROMPTS[0], SamplingParams(n=3, **_fields(SAMPLED)), "a")
    engine.add_request(PROMPTS[1], SamplingParams(n=3, **_fields(SAMPLED)), "b")
    peak_rows = peak_running = 0
    while engine.has_unfinished:
        outs = engine.step()
        peak_rows = max(peak_rows, sum(1 for o in outs if o.new_token_ids))
        peak_running = max(peak_running, engine.num_running)
    assert peak_rows == 3 and peak_running == 3  # "b" waited until "a"'s three seats were free
    assert_pool_clean(engine.block_manager)


def _fields(params: SamplingParams) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "ignore_eos": True}


def test_n_above_max_num_seqs_is_refused_naming_n(model):
    engine = make_engine(model, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="max_num_seqs") as err:
        engine.add_request(PROMPTS[0], SamplingParams(n=3, **_fields(SAMPLED)))
    assert err.value.param == "n"
    assert not engine.has_unfinished


def test_a_step_that_runs_out_of_memory_fails_its_requests_not_the_engine(model):
    engine = make_engine(model)
    engine.add_request(PROMPTS[0], SamplingParams(n=2, **_fields(SAMPLED)), "a")
    engine.add_request(PROMPTS[1], GREEDY, "b")
    real_execute = engine.runner.execute

    def out_of_memory(*args, **kwargs):
        engine.runner.execute = real_execute
        raise torch.OutOfMemoryError("simulated: tried to allocate 20 GiB")

    engine.runner.execute = out_of_memory
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["a", "a.1", "b"]
    assert all(o.finished and o.finish_reason == "error" for o in failed)
    assert all("out of memory" in o.error for o in failed)
    assert not engine.has_unfinished
    assert_pool_clean(engine.block_manager)
    # The engine goes on serving, with exact results.
    engine.add_request(PROMPTS[2], GREEDY, "c")
    tokens = [t for o in run(engine)["c"] for t in o.new_token_ids]
    assert tokens == hf_greedy(model, PROMPTS[2], GREEDY.max_tokens)
    assert_pool_clean(engine.block_manager)


def test_a_row_without_a_usable_logit_fails_that_request_alone(model):
    engine = make_engine(model)
    engine.add_request(PROMPTS[0], GREEDY, "bad")
    engine.add_request(PROMPTS[1], GREEDY, "good")
    sampler = engine.runner.sampler
    draw = sampler.draw

    def poisoned(logits, batch, token_mask=None):
        tokens, logprobs = draw(logits, batch, token_mask)
        tokens[0] = INVALID_TOKEN  # "bad" is the first row of the first step
        sampler.draw = draw
        return tokens, logprobs

    sampler.draw = poisoned
    outs = run(engine)
    [bad] = outs["bad"]
    assert bad.finish_reason == "error" and "non-finite" in bad.error
    assert bad.new_token_ids == [] and bad.num_output_tokens == 0
    tokens = [t for o in outs["good"] for t in o.new_token_ids]
    assert tokens == hf_greedy(model, PROMPTS[1], GREEDY.max_tokens)
    assert_pool_clean(engine.block_manager)


@pytest.mark.parametrize("seed, n", [(2**63, 1), (2**63 - 1, 2), (-(2**63) - 1, 1), (True, 1)])
def test_seeds_outside_int64_are_refused_by_sampling_params(seed, n):
    with pytest.raises(ValueError, match="^seed must be"):
        SamplingParams(seed=seed, n=n)


def test_the_largest_and_smallest_seeds_run(model):
    engine = make_engine(model)
    engine.add_request(PROMPTS[0], SamplingParams(seed=2**63 - 2, n=2, **_fields(SAMPLED)))
    engine.add_request(PROMPTS[1], SamplingParams(seed=-(2**63), **_fields(SAMPLED)))
    outs = run(engine)
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    assert_pool_clean(engine.block_manager)


@pytest.mark.parametrize("value", [1e-300, 0.0099, 2.01, 1e300, float("nan")])
def test_repetition_penalty_is_bounded(value):
    with pytest.raises(ValueError, match="^repetition_penalty must be in"):
        SamplingParams(repetition_penalty=value)


@pytest.mark.parametrize("value", [0.01, 1.0, 2.0])
def test_repetition_penalty_bounds_are_accepted(value):
    assert SamplingParams(repetition_penalty=value).repetition_penalty == value


def _unseeded_seed(model, **config) -> int:
    engine = make_engine(model, **config)
    engine.add_request(PROMPTS[0], SAMPLED)
    return engine.scheduler.waiting[0].seed


def test_unseeded_requests_draw_from_the_os_unless_the_engine_has_a_seed(model):
    # 2^-63 odds of a false failure.
    assert _unseeded_seed(model) != _unseeded_seed(model)
    assert _unseeded_seed(model, seed=5) == _unseeded_seed(model, seed=5)


def _force_alive(monkeypatch) -> None:
    """Simulate the race: the caller's ``is_alive`` check passed just before the loop went."""
    monkeypatch.setattr(AsyncEngine, "is_alive", property(lambda self: True))


def assert_stream_fails_fast(eng: AsyncEngine, prompt: list[int], timeout_s: float) -> None:
    """A stream of ``prompt`` ends in EngineDeadError within ``timeout_s`` (never hangs)."""

    async def stream() -> None:
        with pytest.raises(EngineDeadError):
            async for _ in eng.add_request(prompt, GREEDY):
                pass

    asyncio.run(asyncio.wait_for(stream(), timeout=timeout_s))


def test_add_request_after_the_loop_died_fails_fast(model, monkeypatch):
    eng = AsyncEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model))

    def crash():
        raise RuntimeError("simulated device failure")

    eng.engine.step = crash
    assert_stream_fails_fast(eng, PROMPTS[0], timeout_s=30)
    _force_alive(monkeypatch)
    assert_stream_fails_fast(eng, PROMPTS[1], timeout_s=10)


def test_add_request_after_shutdown_fails_fast(model, monkeypatch):
    eng = AsyncEngine(EngineConfig(kv_cache_memory=2 << 20), loaded=loaded(model))
    eng.shutdown()
    _force_alive(monkeypatch)
    assert_stream_fails_fast(eng, PROMPTS[0], timeout_s=10)
