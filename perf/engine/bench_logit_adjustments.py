"""Host and device cost of penalties and logit bias per step
(``paged_serve.engine.sample.logit_adjustments``).

    python -m perf.engine.bench_logit_adjustments [--device cpu] [--vocab 49152] [--repeats 5]

Every row asks for repetition 1.2, frequency 0.5 and a 3-token logit bias; rows have
``prompt`` prompt tokens and 100 generated ones. Prints milliseconds per ``adjust_logits``
call (the mean of ``--repeats`` calls after one warm-up, synchronised on CUDA).
"""

from __future__ import annotations

import argparse
import time

import torch

from paged_serve.engine.sample.logit_adjustments import adjust_logits
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.request import Request

CASES = ((8, 500), (64, 2000))  # (rows, prompt tokens)


def time_case(rows: int, prompt: int, vocab: int, device: torch.device, repeats: int) -> float:
    """Milliseconds per ``adjust_logits`` call for ``rows`` penalised rows."""
    params = SamplingParams(
        repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={1: 2.0, 2: -1.0, 3: 0.5}
    )
    gen = torch.Generator().manual_seed(0)
    requests = []
    for i in range(rows):
        ids = torch.randint(0, vocab, (prompt + 100,), generator=gen).tolist()
        request = Request(f"r{i}", ids[:prompt], params, seed=0)
        request.output_token_ids.extend(ids[prompt:])
        requests.append(request)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    adjust_logits(logits, requests)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        adjust_logits(logits, requests)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for rows, prompt in CASES:
        ms = time_case(rows, prompt, args.vocab, device, args.repeats)
        print(f"{rows} rows x ({prompt} prompt + 100 output) tokens, V={args.vocab}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
