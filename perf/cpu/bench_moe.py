"""A mixture-of-experts decode step on the CPU: paged-serve against Hugging Face, same model.

``python -m perf.cpu.bench_moe [--streams 1 8] [--experts 16] [--top-k 2] [--hidden 1024]`` builds a
random-weight Qwen3-MoE (``--layers`` layers, every MLP a mixture of ``--experts`` experts of
width ``--moe-intermediate``, top-k routing, fp32 or ``--dtype``) and times, per decode step
(median over ``--steps`` steps after a ``--context``-token prompt per stream, in ms):

* ``hf_eager``: HF's own forward with its eager experts (a Python loop over every expert a
  token chose: what ``experts_implementation="eager"`` runs) and its sdpa attention over a
  ``DynamicCache``, ``streams`` rows a step;
* ``hf_grouped``: the same with HF's ``grouped_mm`` experts (its default where torch has it);
* ``paged_serve``: ``LLMEngine.step`` with ``streams`` requests decoding one token each (the fused
  MoE pass of engine/platform/cpu/moe.py, paged attention, sampling and detokenizing included);
  ``--quantization int8`` quantizes its projections and experts (HF's stay as loaded).

and the step's weight-read floor:

* ``read_floor``: the time to read, once, exactly the weights the step must read (every
  attention projection, the router, each expert some stream chose in HF's last step, the LM
  head), timed as one ``torch.sum`` per weight: what any engine pays to stream those bytes
  through this CPU, whatever its kernels. ``weights_mb`` is their size and ``floor_gb_s`` the
  read bandwidth reached.

Ratios are HF's step time over paged-serve's; ``*_over_floor`` are step times over the floor.
Prints one JSON object. Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.sampling_params import SamplingParams


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


Step = Callable[[], None]


@torch.inference_mode()
def hf_decoder(model: torch.nn.Module, streams: int, args: argparse.Namespace) -> Step:
    """HF's forward after a ``context``-token prefill of ``streams`` rows: one greedy decode
    step per call, over a ``DynamicCache``."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (streams, args.context), generator=gen)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step() -> None:
        nonlocal token
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def hf_step_ms(model: torch.nn.Module, streams: int, args: argparse.Namespace) -> float:
    """Median ms of HF decode steps for ``streams`` rows after a ``context``-token prefill."""
    return median_ms([hf_decoder(model, streams, args)], args.steps)[0]


def median_ms(steps: list[Step], rounds: int) -> list[float]:
    """Each step's median ms over ``rounds`` rounds, the steps taking turns within a round
    (so a slow spell of the machine falls on all of them alike); the first round dropped."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for step, spent in zip(steps, times):
            start = time.perf_counter()
            step()
            spent.append(time.perf_counter() - start)
    return [1e3 * statistics.median(spent[1:]) for spent in times]


def chosen_experts(model: Qwen3MoeForCausalLM, streams: int, args: argparse.Namespace) -> list:
    """Per layer, the distinct experts HF's router chose in the last decode step measured."""
    chosen: list = []
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out: chosen.append(sorted(set(out[2].flatten().tolist())))
        )
        for layer in model.model.layers
    ]
    with torch.inference_mode():
        hf_step_ms(model, streams, argparse.Namespace(**{**vars(args), "steps": 2}))
    for hook in hooks:
        hook.remove()
    return chosen[-len(model.model.layers) :]


@torch.inference_mode()
def read_floor_ms(model: Qwen3MoeForCausalLM, streams: int, args: argparse.Namespace) -> tuple:
    """(median ms, MB) of reading once every weight one decode step of ``streams`` reads."""
    weights = []
    for layer, experts in zip(model.model.layers, chosen_experts(model, streams, args)):
        attn = layer.self_attn
        weights += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        weights += [attn.o_proj.weight, layer.mlp.gate.weight]
        for e in experts:
            weights += [layer.mlp.experts.gate_up_proj[e], layer.mlp.experts.down_proj[e]]
    weights.append(model.lm_head.weight)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for w in weights:
            torch.sum(w)
        times.append(time.perf_counter() - start)
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    return 1e3 * statistics.median(times[1:]), megabytes


def paged_decoder(
    model: torch.nn.Module, streams: int, args: argparse.Namespace
) -> tuple[Step, Step]:
    """An engine on a copy of ``model`` with ``streams`` requests prefilled: ``(step,
    shutdown)``, ``step`` one ``LLMEngine.step`` of them decoding together (``args.steps + 1``
    steps at least), one token per stream: speculative decoding off, as HF's step is (with it,
    a step verifies several drafted tokens per stream: more rows, another measure)."""
    loaded = LoadedModel(
        model=copy.deepcopy(model),
        tokenizer=None,
        name="bench-moe",
        max_model_len=4096,
        eos_token_ids=(),
        load_seconds=0.0,
    )
    config = EngineConfig(
        kv_cache_memory=256 << 20,
        max_num_seqs=max(8, streams),
        quantization=args.quantization,
        speculative_config=None,
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
    return engine.step, engine.shutdown


def paged_step_ms(model: torch.nn.Module, streams: int, args: argparse.Namespace) -> float:
    """Median ms of ``LLMEngine.step`` while ``streams`` requests decode together."""
    step, shutdown = paged_decoder(model, streams, args)
    try:
        return median_ms([step], args.steps)[0]
    finally:
        shutdown()


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
        floor_ms, megabytes = read_floor_ms(model, streams, args)
        row["read_floor_ms"] = round(floor_ms, 2)
        row["weights_mb"] = round(megabytes, 1)
        row["floor_gb_s"] = round(megabytes / floor_ms, 2)
        row["paged_serve_over_floor"] = round(row["paged_serve_ms"] / floor_ms, 2)
        row["hf_eager_over_floor"] = round(row["hf_eager_ms"] / floor_ms, 2)
        row["over_hf_eager"] = round(row["hf_eager_ms"] / row["paged_serve_ms"], 2)
        row["over_hf_grouped"] = round(row["hf_grouped_ms"] / row["paged_serve_ms"], 2)
        rows.append(row)
    print(
        json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
