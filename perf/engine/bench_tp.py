"""Per-step cost of tensor parallelism: step time and time inside collectives, TP=1 against TP=N.

The driver's ``torch.distributed.all_reduce`` and ``broadcast`` are wrapped with timers (the
row-parallel layers and the step channel call them through the module, so the wrappers see every
call), then a batch of requests is prefilled and decoded. For each phase the table gives the mean
wall time of a step, the time the driver spent in all-reduces (two per layer, plus waiting for the
slowest rank) and in the step message broadcast, and their share of the step.

On the CPU the point is the overhead, not speed: the ranks share the host's cores (each rank gets
``cores / N`` threads; ``--threads 1`` gives TP=1 one thread too, for a like-for-like step). On
CUDA the same command measures NCCL all-reduces (``--device cuda``); a replayed decode graph's
collectives never reach the Python wrappers, so read the collective columns of ``--modes eager``.

    python -m perf.engine.bench_tp --tp 1 2 --threads 1 --check  # random Llama, 8 layers, 512 wide
    python -m perf.engine.bench_tp --tp 1 2 --device cuda --modes eager graphs --check

``--check`` exits 1 unless every run's greedy tokens equal those of the first (TP=1, eager).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.sampling_params import SamplingParams

COLLECTIVES = ("all_reduce", "broadcast")


class CollectiveTimer:
    """Wraps ``torch.distributed``'s collectives in this process; ``seconds[name]`` accumulates
    the wall time spent inside each (on CUDA after a synchronize, so the time is the device's)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.device = device
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            sync = self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
            if sync:
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out

        return timed

    def install(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, self._wrap(name, fn))

    def remove(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


@dataclass(frozen=True)
class PhaseStats:
    steps: int
    step_ms: float
    all_reduce_ms: float
    broadcast_ms: float

    @property
    def share(self) -> float:
        return (self.all_reduce_ms + self.broadcast_ms) / self.step_ms if self.step_ms else 0.0


def random_llama(layers: int, hidden: int, heads: int, kv_heads: int) -> LoadedModel:
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, None, "random-llama", (), 2048, 0.0)


def run_phase(engine: LLMEngine, timer: CollectiveTimer, until: Callable[[], bool]) -> PhaseStats:
    steps, wall = 0, 0.0
    before = timer.snapshot()
    while not until():
        start = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - start
        steps += 1
    after = timer.snapshot()

    def per_step_ms(name: str) -> float:
        return 1000 * (after.get(name, 0.0) - before.get(name, 0.0)) / max(steps, 1)

    return PhaseStats(
        steps, 1000 * wall / max(steps, 1), per_step_ms("all_reduce"), per_step_ms("broadcast")
    )


def bench(
    args: argparse.Namespace, tp: int, eager: bool
) -> tuple[PhaseStats, PhaseStats, list[list[int]]]:
    """(prefill phase, decode phase, greedy tokens) of ``--batch`` requests at TP=``tp``."""
    device = torch.device(args.device)
    if device.type == "cpu":  # the driver's threads: as many as each worker gets
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // tp))
    loaded = None
    if args.model is None:
        loaded = random_llama(args.layers, args.hidden, args.heads, args.kv_heads)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.batch * args.prompt_len,
        enforce_eager=eager,
    )
    timer = CollectiveTimer(device)
    timer.install()
    engine = LLMEngine(config, loaded=loaded)
    try:
        gen = torch.Generator().manual_seed(1)
        vocab = engine.vocab_size
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(args.prompt_len)), warm)  # first-call costs, unmeasured
        while engine.has_unfinished:
            engine.step()
        params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
        for _ in range(args.batch):
            prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(prompt, params)
        requests = list(engine.scheduler.waiting)
        prefill = run_phase(engine, timer, lambda: all(r.output_token_ids for r in requests))
        decode = run_phase(engine, timer, lambda: not engine.has_unfinished)
    finally:
        engine.shutdown()
        timer.remove()
    return prefill, decode, [list(r.output_token_ids) for r in requests]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default=None, help="a model folder/id (default: random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU: the driver's torch threads (default: cores / TP, what each worker takes)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("eager", "graphs"),
        default=["eager"],
        help="eager steps, and/or decode CUDA graphs (CUDA only)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless all tokens agree")
    args = parser.parse_args(argv)
    print(
        "| TP | mode | phase | steps | step ms | all_reduce ms/step | broadcast ms/step | "
        "collectives / step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    reference, mismatches = None, []
    for mode in args.modes:
        for tp in args.tp:
            *phases, tokens = bench(args, tp, eager=mode == "eager")
            for phase, s in zip(("prefill", "decode"), phases):
                print(
                    f"| {tp} | {mode} | {phase} | {s.steps} | {s.step_ms:.2f} | "
                    f"{s.all_reduce_ms:.2f} | {s.broadcast_ms:.3f} | {100 * s.share:.0f}% |",
                    flush=True,
                )
            reference = tokens if reference is None else reference
            if tokens != reference:
                mismatches.append(f"TP={tp} {mode}")
    if args.check:
        verdict = "no: " + ", ".join(mismatches) if mismatches else "yes"
        print(f"greedy tokens equal the first run's: {verdict}")
        if mismatches:
            sys.exit(1)


if __name__ == "__main__":
    main()
