"""The decoder body against Hugging Face's forward, per family: one engine decode step on the CPU.

``python -m perf.cpu.bench_body [--family llama gemma3_text qwen3_moe ...] [--streams 1 8]`` builds,
per family of ``architecture.FAST_BODY_ARCHITECTURES`` (by ``model_type``), a random model of
one shape (``--hidden`` wide, ``--layers`` deep, 16 heads of 64 over 4 KV heads; mixtures of
experts: ``--experts`` experts of width ``--moe-intermediate``, top-2; latent attention: a
256-lane latent), fp32 or ``--dtype``, and
two engines on it with ``streams`` requests decoding after a ``--context``-token prompt: one
running the body (engine/model/body/), one HF's own decoder forward (``runner.body = None``),
everything else alike. Their ``LLMEngine.step`` times (ms, medians over ``--steps`` steps, the
two engines taking turns step by step, so a slow spell of the machine falls on both) and
``hf_over_body`` (above 1: the body is faster). Prints one JSON object. Timing belongs here,
never in tests.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from perf.cpu.bench_moe import median_ms, paged_decoder

FAMILIES = (
    "llama",
    "qwen3",
    "phi3",
    "olmo2",
    "granite",
    "gemma3_text",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
    "glm4_moe",
    "deepseek_v3",
    "glm4_moe_lite",
    "qwen3_next",
    "qwen3_5_text",
    "cohere",
)


LATENT_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
# Latent attention: a 256-lane latent, a 64-lane rope key (the head_dim HF's rotary reads).
LATENT = dict(
    kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64
)


def build(family: str, args: argparse.Namespace) -> torch.nn.Module:
    """A random ``family`` model of the benchmark's shape (keys a family lacks are ignored)."""
    config = AutoConfig.for_model(
        family,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        query_pre_attn_scalar=64,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=args.moe_intermediate * 2,
        n_routed_experts=args.experts,  # DeepSeek's names
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,  # inside the vocabulary (Phi-3's default is not)
        bos_token_id=1,
        eos_token_id=2,
        **(LATENT if family in LATENT_FAMILIES else {}),
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(getattr(torch, args.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", nargs="+", default=list(FAMILIES))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    args.quantization = None  # what paged_decoder reads
    rows = []
    for family in args.family:
        model = build(family, args)
        for streams in args.streams:
            body_step, body_done = paged_decoder(model, streams, args)
            hf_step, hf_done = paged_decoder(model, streams, args)
            runner = hf_step.__self__.runner
            if body_step.__self__.runner.body is None:
                raise SystemExit(f"{family} does not run the body: nothing to compare")
            runner.body = None
            try:
                body_ms, hf_ms = median_ms([body_step, hf_step], args.steps)
            finally:
                body_done()
                hf_done()
            row = {"family": family, "streams": streams, "body_ms": round(body_ms, 2)}
            row |= {"hf_forward_ms": round(hf_ms, 2), "hf_over_body": round(hf_ms / body_ms, 3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
