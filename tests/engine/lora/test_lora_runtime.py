"""Adapters loaded and unloaded while requests run; adapters kept in host memory; decode graphs
and the tensor-parallel step message carrying adapter slots."""

from __future__ import annotations

import pytest

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.lora.config import LoRAConfig
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, EagerReplay
from paged_serve.engine.runner.step_inputs import StepInputs
from paged_serve.engine.runner.step_message import STEP, StepMessage, pack_step, unpack_step
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.lora_adapters import make_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tiny_model("llama")
    folder = tmp_path_factory.mktemp("runtime")
    merged = {name: make_adapter(base, folder / name, seed=i) for i, name in enumerate("xyz")}
    prompts = random_prompts([9, 20], seed=3)
    want = {(n, i): hf_greedy(m, p, 10) for n, m in merged.items() for i, p in enumerate(prompts)}
    return base, folder, prompts, want


def engine_with(base, **lora: object) -> LLMEngine:
    config = EngineConfig(kv_cache_memory=2 << 20, lora=LoRAConfig(max_lora_rank=8, **lora))
    return LLMEngine(config, loaded=loaded(base))


def load(engine: LLMEngine, name: str, folder) -> LoRAAdapter:
    return engine.loras.add(engine.loras.read(name, str(folder / name)))


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert_pool_clean(engine.block_manager)
    engine.scheduler.check_adapter_slots()
    return got


def test_unload_while_requests_run_on_it(setup):
    """Unloading takes the name away at once; the running and the still-waiting requests on
    it finish on it, then its slot empties."""
    base, folder, prompts, want = setup
    engine = engine_with(base, max_loras=1)
    load(engine, "x", folder)
    load(engine, "y", folder)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request(prompts[0], GREEDY, request_id="running", lora="x")
    step()
    engine.add_request(prompts[1], GREEDY, request_id="waiting", lora="y")  # x holds the slot
    step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["waiting"]
    engine.loras.remove("x")
    engine.loras.remove("y")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'x'"):
        engine.add_request(prompts[0], GREEDY, lora="x")
    for rid, tokens in drain(engine).items():
        got.setdefault(rid, []).extend(tokens)
    assert got["running"] == want[("x", 0)]
    assert got["waiting"] == want[("y", 1)]
    assert engine.loras.slots.loaded() == []


def test_load_while_others_run(setup):
    base, folder, prompts, want = setup
    engine = engine_with(base, max_loras=2)
    load(engine, "x", folder)
    engine.add_request(prompts[0], GREEDY, request_id="first", lora="x")
    engine.step()
    load(engine, "z", folder)
    engine.add_request(prompts[1], GREEDY, request_id="second", lora="z")
    got = drain(engine)
    assert got["second"] == want[("z", 1)]


def test_host_memory_keeps_the_most_recent_adapters(setup):
    """With --max-cpu-loras 2 the third adapter read drops the least recently used; a slot
    filled with a dropped adapter reads its folder again and still gives its tokens."""
    base, folder, prompts, want = setup
    engine = engine_with(base, max_loras=1, max_cpu_loras=2)
    ids = {name: load(engine, name, folder).id for name in "xyz"}
    assert engine.runner.adapters.in_host_memory == [ids["y"], ids["z"]]
    engine.add_request(prompts[0], GREEDY, request_id="x0", lora="x")
    assert drain(engine)["x0"] == want[("x", 0)]
    assert engine.runner.adapters.in_host_memory == [ids["z"], ids["x"]]


def test_decode_graphs_replay_any_mix_of_adapters(setup):
    """Emulated decode graphs (static slot and mask buffers) give each adapter's tokens."""
    base, folder, prompts, want = setup
    engine = engine_with(base, max_loras=3)
    for name in "xyz":
        load(engine, name, folder)
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model,
        runner.kv_cache,
        runner.backend,
        max_batch_size=8,
        max_model_len=engine.max_model_len,
        max_loras=3,
    )
    runner.enable_decode_graphs(graphs, EagerReplay())
    for name in "xyz":
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, GREEDY, request_id=f"{name}{i}", lora=name)
    engine.add_request(prompts[1], GREEDY, request_id="base")
    got = drain(engine)
    assert sum(graphs.replays.values()) > 0
    assert all(got[f"{n}{i}"] == want[(n, i)] for n in "xyz" for i in range(2))
    assert got["base"] == hf_greedy(base, prompts[1], 10)


def test_the_step_message_carries_adapter_slots_and_loads():
    inputs = StepInputs([5, 6], [0, 1], [0, 1], [0, 2], [2], [[0]], [1], lora_slots=[1, -1])
    loads = [(1, LoRAAdapter(7, "näme", "/tmp/a b/ä", 16))]
    message = unpack_step(pack_step(StepMessage(STEP, [(0, 1)], inputs, [], loads)))
    assert message.inputs == inputs
    assert message.lora_loads == loads
    assert message.block_copies == [(0, 1)]


def test_triton_backend_adds_adapters_through_the_kernels(setup):
    """The Triton shrink and expand (under the interpreter here) in the engine: a batch of the
    base model and two adapters gives peft's merged tokens."""
    base, folder, prompts, want = setup
    config = EngineConfig(
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
    )
    engine = LLMEngine(config, loaded=loaded(base))
    assert engine.backend_name == "triton"
    for name in "xy":
        load(engine, name, folder)
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for name in ("x", "y", None):
        engine.add_request(prompts[0], few, request_id=f"{name}", lora=name)
    got = drain(engine)
    assert got["x"] == want[("x", 0)][:4] and got["y"] == want[("y", 0)][:4]
    assert got["None"] == hf_greedy(base, prompts[0], 4)


def test_rslora_scaling(setup, tmp_path):
    """rsLoRA scales ``B A`` by ``alpha / sqrt(r)``, not ``alpha / r``: peft's merged tokens."""
    base, _, prompts, _ = setup
    merged = make_adapter(base, tmp_path / "rs", seed=9, rank=8, alpha=4, use_rslora=True)
    want = hf_greedy(merged, prompts[1], 10)
    assert want != hf_greedy(base, prompts[1], 10)
    engine = engine_with(base)
    engine.loras.add(engine.loras.read("rs", str(tmp_path / "rs")))
    engine.add_request(prompts[1], GREEDY, request_id="rs", lora="rs")
    assert drain(engine)["rs"] == want
