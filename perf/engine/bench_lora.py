"""Decode throughput with LoRA adapters on the CPU: paged-serve's engine serving 0, 1, 4 and 16
distinct adapters in one batch, against the same engine serving the base model alone and
against Hugging Face + peft switching adapters per request, in one process, one run.

    python -m perf.engine.bench_lora [--streams 8 32] [--adapters 0 1 4 16] [--rank 16]

The model is a random-weight Llama (``--hidden`` 768 and ``--intermediate`` 2048 by default,
8 layers, query heads of 64 lanes, 4 KV heads, a 16000-token vocabulary; 75 M parameters at the
default sizes, fp32), the adapters random rank-``--rank`` LoRA on
all seven projections of every layer, written in peft's format (``adapter_config.json``,
``adapter_model.safetensors``). Each case runs ``S`` requests at once (``--streams``), each a
32-token prompt and ``--new-tokens`` greedy tokens, the ``i``-th on adapter ``i mod k`` (``k``
0: the base model on the LoRA engine); tokens/s is generated tokens over the wall time of
``LLM.generate`` (prefill included), the median of ``--repeats`` runs after one warm-up. The
LoRA engine holds ``--max-loras 16`` slots of rank ``--rank``. Hugging Face + peft runs the
requests one by one (``PeftModel.set_adapter`` then ``generate``), over ``--hf-requests`` of them.
One check of agreement: the first adapter's greedy tokens from both. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from paged_serve.engine.llm import LLM
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.sampling_params import SamplingParams

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def build_model(hidden: int, intermediate: int) -> LlamaForCausalLM:
    """The benchmark's random Llama: ``hidden`` wide (heads of 64), ``intermediate`` MLP."""
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=8,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write_adapter(model: LlamaForCausalLM, folder: Path, rank: int, seed: int) -> None:
    """A random rank-``rank`` LoRA adapter of ``model`` on every projection, as peft saves it."""
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for owner, names in PROJECTIONS.items():
            for name in names:
                linear = getattr(getattr(layer, owner), name)
                key = f"base_model.model.model.layers.{index}.{owner}.{name}"
                a = torch.randn(rank, linear.in_features, generator=generator)
                b = torch.randn(linear.out_features, rank, generator=generator)
                tensors[f"{key}.lora_A.weight"] = a / math.sqrt(linear.in_features)
                tensors[f"{key}.lora_B.weight"] = b * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in PROJECTIONS.values() for n in names],
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))


def loaded(model: LlamaForCausalLM) -> LoadedModel:
    """A private copy of ``model`` for an engine (which rewrites its projections)."""
    return LoadedModel(
        model=copy.deepcopy(model),
        tokenizer=None,
        name="bench-llama",
        eos_token_ids=(),
        max_model_len=2048,
        load_seconds=0.0,
    )


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 16000, (32,), generator=generator).tolist() for _ in range(count)]


def throughput(llm: LLM, streams: int, adapters: int, args: argparse.Namespace) -> float:
    """Generated tokens/s of ``streams`` requests at once over ``adapters`` distinct adapters."""
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    batch = prompts(streams)
    names = [None if adapters == 0 else f"a{i % adapters}" for i in range(streams)]

    def run() -> None:
        engine = llm.engine
        for i, prompt in enumerate(batch):
            engine.add_request(prompt, params, request_id=f"r{i}", lora=names[i])
        while engine.has_unfinished:
            engine.step()

    run()  # warm-up: every adapter into its slot, the allocator's pools
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return streams * args.new_tokens / statistics.median(times)


def hf_peft(model: LlamaForCausalLM, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Hugging Face + peft, one request at a time, switching adapters per request."""
    peft_model = PeftModel.from_pretrained(model, str(root / "a0"), adapter_name="a0")
    count = min(args.hf_requests, max(args.adapters))
    for i in range(1, count):
        peft_model.load_adapter(str(root / f"a{i}"), adapter_name=f"a{i}")
    config = GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    batch = prompts(args.hf_requests)
    outputs = []
    with torch.inference_mode():
        peft_model.set_adapter("a0")
        ids = torch.tensor([batch[0]])
        peft_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        start = time.perf_counter()
        for i, prompt in enumerate(batch):
            peft_model.set_adapter(f"a{i % count}")
            ids = torch.tensor([prompt])
            out = peft_model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            outputs.append(out[0, len(prompt) :].tolist())
        seconds = time.perf_counter() - start
    return {
        "requests": len(batch),
        "tokens_per_s": round(len(batch) * args.new_tokens / seconds, 1),
        "first_tokens": outputs[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-requests", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    args = parser.parse_args()
    model = build_model(args.hidden, args.intermediate)
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "rank": args.rank,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(max(args.adapters)):
            write_adapter(model, root / f"a{i}", args.rank, seed=i)
        settings = {"kv_cache_memory": 512 << 20, "max_num_seqs": max(args.streams)}
        base = LLM(loaded=loaded(model), **settings)
        modules = tuple(LoRAModule(f"a{i}", str(root / f"a{i}")) for i in range(max(args.adapters)))
        lora = LoRAConfig(max_loras=16, max_lora_rank=args.rank, modules=modules)
        served = LLM(loaded=loaded(model), lora=lora, **settings)
        check = served.generate(
            [prompts(1)[0]],
            SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True),
            lora="a0",
        )[0].token_ids
        for streams in args.streams:
            alone = throughput(base, streams, 0, args)
            case = {"streams": streams, "base_tokens_per_s": round(alone, 1), "lora": []}
            for adapters in args.adapters:
                rate = throughput(served, streams, adapters, args)
                case["lora"].append(
                    {
                        "adapters": adapters,
                        "tokens_per_s": round(rate, 1),
                        "ratio_to_base": round(rate / alone, 3),
                    }
                )
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
        del base, served
        hf = hf_peft(model, root, args)
    report["hf_peft"] = {k: v for k, v in hf.items() if k != "first_tokens"}
    report["agreement_first_adapter"] = hf["first_tokens"] == check
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
