"""A DeepSeek-V3 (multi-head latent attention) decode step on the CPU: paged-serve against Hugging
Face, same model.

``python -m perf.cpu.bench_mla [--streams 1 8] [--context 512] [--hidden 1024]`` builds a
random-weight ``DeepseekV3ForCausalLM`` (``--layers`` layers, the first dense and the rest a
mixture of ``--experts`` routed experts and one shared one; ``--heads`` heads with a
``--kv-lora-rank`` latent, 32-lane rope part, 64-lane nope and value heads, a 384-rank query)
and times, per decode step (median over ``--steps`` steps after a ``--context``-token prompt
per stream, in ms):

* ``hf_ms``: HF's own forward (its default sdpa attention and grouped experts) over a
  ``DynamicCache``, which caches the latent and up-projects every cached token's keys and values
  with ``kv_b_proj`` at every step;
* ``paged_serve_ms``: ``LLMEngine.step`` with ``streams`` requests decoding together: absorbed
  queries over the paged latent cache (``engine/model/latent_attention.py``), the fused MoE pass,
  sampling and detokenizing included;

and prints them with the ratio ``over_hf`` (HF's step time over paged-serve's) as one JSON
object, beside the latent cache's bytes per token against the per-head layout's. Timing
belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from paged_serve.engine.kv.kv_cache import KVCache, cache_layout, per_head_elements_per_token
from perf.cpu.bench_moe import hf_step_ms, paged_step_ms


def build_model(args: argparse.Namespace) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        first_k_dense_replace=1,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=384,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval().to(getattr(torch, args.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-lora-rank", type=int, default=256)
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
    config = model.config
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    latent = KVCache.bytes_per_block(
        num_layers=config.num_hidden_layers,
        block_size=1,
        layout=cache_layout(config),
        dtype=getattr(torch, args.dtype),
    )
    per_head = config.num_hidden_layers * per_head_elements_per_token(config) * itemsize
    rows = []
    for streams in args.streams:
        row: dict[str, float] = {"streams": streams}
        row["hf_ms"] = round(hf_step_ms(model, streams, args), 2)
        row["paged_serve_ms"] = round(paged_step_ms(model, streams, args), 2)
        row["over_hf"] = round(row["hf_ms"] / row["paged_serve_ms"], 2)
        rows.append(row)
    report = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "kv_bytes_per_token": {"latent": latent, "per_head": per_head},
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
