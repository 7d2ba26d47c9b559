"""The torch sampler's draw on the CPU: ``paged_serve.engine.sample.eager_sampling`` against
``sample_ref``.

``python -m perf.cpu.bench_sampling [--vocab 49152] [--batches 1 8 24] [--rounds 9]``

``reference.sample_ref`` (the oracle the draw is proved against) sorts every row twice and
searches every token's place whatever the row asks for; ``engine/sample/eager_sampling.py`` computes
only the filters a row asks for. This times
both on the same logits, uniforms and filters (a seed per row, temperature 0.8 unless the mix
says otherwise), checks that they give the same tokens and logprobs, and prints each one's
median time and the ratio. Mixes: the OpenAI default (temperature 1, no filter), top_k=50,
top_p=0.9, top_p=0.95 with top_k=50, and min_p=0.05.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from paged_serve.engine.platform.cpu.host_malloc import keep_freed_memory
from paged_serve.engine.sample.eager_sampling import sample_eager
from paged_serve.kernels.reference import sample_ref
from perf.wall_timing import median_wall_s

MIXES: dict[str, tuple[float, int, float, float]] = {  # temperature, top_k, top_p, min_p
    "default (T=1)": (1.0, 0, 1.0, 0.0),
    "top_k=50": (0.8, 50, 1.0, 0.0),
    "top_p=0.9": (0.8, 0, 0.9, 0.0),
    "top_k=50 top_p=0.95": (0.8, 50, 0.95, 0.0),
    "min_p=0.05": (0.8, 0, 1.0, 0.05),
}


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    """Median wall time of ``fn`` over ``rounds`` calls after one warm-up, in ms."""
    fn()
    return median_wall_s(fn, rounds) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 24])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the engine does on the CPU
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {args.vocab}")
    print(f"{'rows':>4}  {'mix':<20} {'reference ms':>12} {'eager ms':>9} {'ratio':>7}")
    for rows in args.batches:
        logits = torch.randn(rows, args.vocab, generator=gen) * args.logit_scale
        uniforms = torch.rand(rows, args.vocab, generator=gen)
        for name, (temperature, top_k, top_p, min_p) in MIXES.items():
            params = dict(
                temperature=torch.full((rows,), temperature),
                top_k=torch.full((rows,), top_k, dtype=torch.int32),
                top_p=torch.full((rows,), top_p),
                min_p=torch.full((rows,), min_p),
                uniforms=uniforms,
            )
            want, got = sample_ref(logits, **params), sample_eager(logits, **params)
            if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
                raise SystemExit(f"rows {rows}, {name}: eager and reference draws differ")
            ref_ms = median_ms(functools.partial(sample_ref, logits, **params), args.rounds)
            eager_ms = median_ms(functools.partial(sample_eager, logits, **params), args.rounds)
            ratio = ref_ms / eager_ms
            print(f"{rows:>4}  {name:<20} {ref_ms:>12.2f} {eager_ms:>9.3f} {ratio:>6.1f}x")


if __name__ == "__main__":
    main()
