"""A hybrid linear-attention (Qwen3-Next, Qwen3.5) decode step on the CPU: paged-serve against
Hugging Face, same model.

``python -m perf.cpu.bench_hybrid [--model qwen3_next] [--streams 1 8] [--context 512]`` builds
a random-weight model of ``--layers`` layers, three gated DeltaNet layers to one full-attention
layer (Qwen3-Next's pattern: ``--linear-k-heads`` key heads and ``--linear-v-heads`` value heads
of ``--linear-head-dim`` lanes, a 4-wide convolution; gated attention with ``--heads`` query and
2 KV heads of 128 lanes; for Qwen3-Next a mixture of ``--experts`` routed experts and a shared
one in every layer) and times, per decode step (the median of ``--steps`` steps after a
``--context``-token prompt per stream, the two systems taking turns step by step, in ms):

* ``hf_ms``: HF's own forward (sdpa attention; its torch fallbacks for the delta rule and the
  convolution, which is what it runs without flash-linear-attention) over a ``DynamicCache``;
* ``paged_serve_ms``: ``LLMEngine.step`` with ``streams`` requests decoding together: the CPU
  delta rule and convolution over state slots (``engine/platform/cpu/linear_attention.py``),
  paged attention, the MoE pass, sampling and detokenizing included;

and prints them with ``over_hf`` (HF's step time over paged-serve's) as one JSON object,
beside the state bytes per sequence and the KV bytes per token. Timing belongs here, never in
tests.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from paged_serve.engine.kv.kv_cache import KVCache, attention_layer_ids, cache_layout
from paged_serve.engine.kv.state_cache import linear_state_shape
from perf.cpu.bench_moe import hf_decoder, median_ms, paged_decoder


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)
    ]
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        layer_types=layer_types,
        num_attention_heads=args.heads,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if args.model == "qwen3_next":
        config = Qwen3NextConfig(
            **common,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_intermediate,
            shared_expert_intermediate_size=args.moe_intermediate,
        )
        model = Qwen3NextForCausalLM(config)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
    return model.eval().to(getattr(torch, args.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["qwen3_next", "qwen3_5"], default="qwen3_next")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--linear-k-heads", type=int, default=8)
    p.add_argument("--linear-v-heads", type=int, default=16)
    p.add_argument("--linear-head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.quantization = None  # what perf.cpu.bench_moe's paged step reads
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    config, dtype = model.config, getattr(torch, args.dtype)
    kv = KVCache.bytes_per_block(
        num_layers=len(attention_layer_ids(config)),
        block_size=1,
        layout=cache_layout(config),
        dtype=dtype,
    )
    rows = []
    for streams in args.streams:
        row: dict[str, float] = {"streams": streams}
        paged, shutdown = paged_decoder(model, streams, args)
        try:  # the two take turns, step by step (median_ms)
            hf_ms, paged_ms = median_ms([hf_decoder(model, streams, args), paged], args.steps)
        finally:
            shutdown()
        row["hf_ms"], row["paged_serve_ms"] = round(hf_ms, 2), round(paged_ms, 2)
        row["over_hf"] = round(row["hf_ms"] / row["paged_serve_ms"], 2)
        rows.append(row)
    report = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "state_bytes_per_sequence": linear_state_shape(config).bytes_per_slot(dtype),
        "kv_bytes_per_token": kv,
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
