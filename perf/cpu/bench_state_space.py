"""A Mamba-2 hybrid (Bamba's layout, Granite 4.0's pattern) on the CPU: a decode step against
Hugging Face's eager forward, and a conversation's second turn with and without prefix caching
from state snapshots.

``python -m perf.cpu.bench_state_space [--streams 1 8] [--context 512] [--history 2048]``
builds a random-weight ``BambaForCausalLM`` of ``--layers`` layers, one full-attention layer
in every four (the rest Mamba-2 mixers of ``--mamba-heads`` heads of ``--mamba-head-dim``
lanes over one group of a ``--state``-wide state, a 4-wide convolution) and reports, as one JSON
object (ms):

* per decode step (the median of ``--steps`` steps after a ``--context``-token prompt per
  stream, the two systems taking turns step by step): ``hf_ms``, HF's forward over its
  ``DynamicCache`` (its torch fallbacks for the scan and the convolution, what it runs without
  mamba_ssm); ``paged_serve_ms``, ``LLMEngine.step`` with ``streams`` requests decoding together
  (the CPU scan and convolution over state slots, paged attention, sampling included); and
  ``over_hf``, HF's time over paged-serve's;
* a second turn's time to first token (``LLM.generate`` of one token, the median of
  ``--rounds`` conversations): a first turn of ``--history`` prompt tokens and 32 drawn ones,
  then the second turn (the first, its answer and 48 new tokens) on the same engine, with
  state snapshots every ``--interval`` tokens (``cached_ms``) and with none, so nothing hits
  (``uncached_ms``); ``ttft_speedup`` is their ratio.

Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import BambaConfig, BambaForCausalLM

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.model.mamba_mixer import mamba_state_shape
from perf.cpu.bench_moe import hf_decoder, median_ms, paged_decoder

ANSWER, NEW = 32, 48  # tokens of the first turn's answer, and the second turn's new ones


def build_model(args: argparse.Namespace) -> BambaForCausalLM:
    config = BambaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        attn_layer_indices=[i for i in range(args.layers) if (i + 1) % 4 == 0],
        num_attention_heads=args.heads,
        num_key_value_heads=2,
        mamba_n_heads=args.mamba_heads,
        mamba_d_head=args.mamba_head_dim,
        mamba_n_groups=1,
        mamba_d_state=args.state,
        mamba_d_conv=4,
        mamba_expand=args.mamba_heads * args.mamba_head_dim // args.hidden,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return BambaForCausalLM(config).eval().to(getattr(torch, args.dtype))


def second_turn_ms(model: torch.nn.Module, args: argparse.Namespace, interval: int) -> float:
    """Median ms to the first token of a conversation's second turn on an engine keeping state
    snapshots every ``interval`` tokens (0: none)."""
    loaded = LoadedModel(
        model=copy.deepcopy(model),
        tokenizer=None,
        name="bench-ssm",
        max_model_len=8192,
        eos_token_ids=(),
        load_seconds=0.0,
    )
    llm = LLM(
        loaded=loaded,
        kv_cache_memory=512 << 20,
        max_num_seqs=4,
        state_snapshot_interval=interval,
        speculative_config=None,
    )
    gen = torch.Generator().manual_seed(2)
    greedy = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(args.rounds):
        prompt = torch.randint(0, args.vocab, (args.history,), generator=gen).tolist()
        [answer] = llm.generate([prompt], greedy)
        turn2 = prompt + answer.token_ids + torch.randint(0, args.vocab, (NEW,)).tolist()
        start = time.perf_counter()
        llm.generate([turn2], first_token)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mamba-heads", type=int, default=32)
    p.add_argument("--mamba-head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--interval", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.quantization = None  # what perf.cpu.bench_moe's paged step reads
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
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
    cached = second_turn_ms(model, args, args.interval)
    uncached = second_turn_ms(model, args, 0)
    report = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "state_bytes_per_sequence": mamba_state_shape(model).bytes_per_slot(model.dtype),
        "decode": rows,
        "second_turn": {
            "prompt_tokens": args.history + ANSWER + NEW,
            "cached_ms": round(cached, 1),
            "uncached_ms": round(uncached, 1),
            "ttft_speedup": round(uncached / cached, 2),
        },
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
