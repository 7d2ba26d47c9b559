"""LoRA under tensor parallelism (gloo, CPU): each rank holds its share of every adapter (B's rows
beside a column-parallel projection, A's columns beside a row-parallel one) and reads the
adapters' files itself when the driver's step names a slot to fill; TP=2 gives the tokens of
peft's merged model, for a batch mixing the base and two adapters over one slot each step."""

from __future__ import annotations

from paged_serve.engine import LLM
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.lora_adapters import make_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_tp2_equals_peft_merged(tmp_path):
    base = tiny_model("llama")
    merged = {name: make_adapter(base, tmp_path / name, seed=i) for i, name in enumerate("pq")}
    merged[None] = base
    prompts = random_prompts([6, 30], seed=2)
    lora = LoRAConfig(
        max_loras=1,
        max_lora_rank=8,
        modules=tuple(LoRAModule(n, str(tmp_path / n)) for n in "pq"),
    )
    llm = LLM(
        loaded=loaded(base),
        tensor_parallel_size=2,
        kv_cache_memory=2 << 20,
        max_num_batched_tokens=16,
        lora=lora,
    )
    try:
        engine = llm.engine
        for name in (None, "p", "q"):
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, GREEDY, request_id=f"{name}{i}", lora=name)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished:
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for name, model in merged.items():
            for i, prompt in enumerate(prompts):
                assert got[f"{name}{i}"] == hf_greedy(model, prompt, 10), (name, i)
        assert_pool_clean(engine.block_manager)
        engine.scheduler.check_adapter_slots()
    finally:
        llm.shutdown()
