"""A mixture-of-experts decode step on the CPU: paged-serve against Hugging Face, same model.

``python -m perf.bench_moe [--streams 1 8] [--experts 16] [--top-k 2] [--hidden 1024]`` builds a
random-weight Qwen3-MoE (``--layers`` layers, every MLP a mixture of ``--experts`` experts of
width ``--moe-intermediate``, top-k routing, fp32 or ``--dtype``) and times, per decode step
(median over ``--steps`` steps after a ``--context``-token prompt per stream, in ms):

* ``hf_eager``: HF's own forward with its eager experts (a Python loop over every expert a
  token chose: what ``experts_implementation="eager"`` runs) and its sdpa attention over a
  ``DynamicCache``, ``streams`` rows a step;
* ``hf_grouped``: the same with HF's ``grouped_mm`` experts (its default where torch has it);
* ``paged_serve``: ``LLMEngine.step`` with ``streams`` requests decoding together (the fused
  MoE pass of engine/platform/cpu/moe.py, paged attention, sampling and detokenizing included);
  ``--quantization int8`` quantizes its projections and experts (HF's stay as loaded).

Ratios are HF's step time over paged-serve's. Prints one JSON object. Timing belongs here,
never in tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.sampling_params import SamplingParams


def build_model(args: argparse.Namespace) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate * 2,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval().to(getattr(torch, args.dtype))


@torch.inference_mode()
def hf_step_ms(model: Qwen3MoeForCausalLM, streams: int, args: argparse.Namespace) -> float:
    """Median ms of HF decode steps for ``streams`` rows after a ``context``-token prefill."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (streams, args.context), generator=gen)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def paged_step_ms(model: Qwen3MoeForCausalLM, streams: int, args: argparse.Namespace) -> float:
    """Median ms of ``LLMEngine.step`` while ``streams`` requests decode together."""
    loaded = LoadedModel(
        model=copy.deepcopy(model),
        tokenizer=None,
        name="bench-moe",
        max_model_len=4096,
        eos_token_ids=(),
        load_seconds=0.0,
    )
    config = EngineConfig(
        kv_cache_memory=256 << 20, max_num_seqs=max(8, streams), quantization=args.quantization
    )
    engine = LLMEngine(config, loaded)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(streams):
        engine.add_request(
            torch.randint(0, args.vocab, (args.context,), generator=gen).tolist(), params
        )
    while (
        any(len(r.output_token_ids) == 0 for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # prefill
    times = []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.shutdown()
    return 1e3 * statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", choices=("int8",), default=None, help="paged-serve's only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    rows = []
    for streams in args.streams:
        row = {"streams": streams}
        for name, implementation in (("hf_eager", "eager"), ("hf_grouped", "grouped_mm")):
            model.set_experts_implementation(implementation)
            row[f"{name}_ms"] = round(hf_step_ms(model, streams, args), 2)
        model.set_experts_implementation("grouped_mm")
        row["paged_serve_ms"] = round(paged_step_ms(model, streams, args), 2)
        row["over_hf_eager"] = round(row["hf_eager_ms"] / row["paged_serve_ms"], 2)
        row["over_hf_grouped"] = round(row["hf_grouped_ms"] / row["paged_serve_ms"], 2)
        rows.append(row)
    print(
        json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
