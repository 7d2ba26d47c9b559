"""Where a CPU decode step's time goes, per engine mode: the model body against the rest.

``python -m perf.cpu.bench_step [--streams 1 8] [--modes float32 bfloat16 ...]`` runs the engine
alone (``LLMEngine.step`` in a loop, no server) on the default model with ``streams`` requests
decoding together, and reports per decode step (p50 over the steps, in ms): the whole step, the
forward (``ModelRunner.forward``: the model body and the LM head) and the rest (scheduling,
sampling, detokenizing, stop checks). A mode is a dtype, optionally ``+int8`` or ``+int4``
(weight-only), ``+unfused`` (q/k/v and gate/up as separate GEMMs, Hugging Face's layout), ``+plain``
(projections as plain ``F.linear``, without engine/platform/cpu/linears.py), ``+columns`` or
``+packed`` (fp32's few-row kernel forced instead of the one chosen at load), ``+hf`` (Hugging
Face's own forward instead of engine/model/body/), ``+hflayout`` (a quantized model's lone decode
row in HF's attention layout, as unquantized ones) or ``+gather`` (decode rows attended by torch's
gather and SDPA, without the C kernel of kernels/cpu/decode_attention.py; the K/V write stays in C),
e.g. ``float32+plain``.
Each mode runs in its own process, so one mode's allocations and threads do not shape
another's; ``--rounds N`` runs the modes N times, interleaved, and reports each mode's median
round (by step time) with every round's step time, since this box's noise moves one run by tens
of percent. Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT_MODES = ("float32+plain", "float32", "bfloat16", "bfloat16+int8")
PROMPT_TOKENS = 64  # per request, distinct per stream so no prefix is shared
DECODE_TOKENS = 48  # per request; every request runs to its limit


def measure(mode: str, streams: int, threads: int | None) -> dict:
    """Per-step p50 times (ms) of one mode with ``streams`` concurrent requests (this process)."""
    import torch

    import paged_serve.engine.model.prep as model_prep
    import paged_serve.engine.platform.cpu.linears as cpu_linears
    from paged_serve.engine.llm import LLM
    from paged_serve.engine.model.loader import load_model
    from paged_serve.engine.sampling_params import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    dtype_name, *flags = mode.split("+")
    if "unfused" in flags:
        model_prep.fuse_projections = lambda model: 0  # separate GEMMs, for the A/B
    if "plain" in flags:
        cpu_linears.speed_up_cpu_linears = lambda model: 0  # plain F.linear, for the A/B
    loaded = load_model(None, dtype=getattr(torch, dtype_name), device=torch.device("cpu"))
    quantization = next((flag for flag in flags if flag in ("int8", "int4")), None)
    llm = LLM(loaded=loaded, quantization=quantization)
    runner = llm.engine.runner
    swapped = (cpu_linears.PackedLinear, cpu_linears.Fp32Linear)
    plain = not any(isinstance(m, swapped) for m in runner.model.modules())
    if quantization is None and plain != ("plain" in flags):  # int8/int4 swap them all
        raise RuntimeError(f"{mode}: the projections' kernels are not what the mode names")
    fp32 = [m for m in runner.model.modules() if isinstance(m, cpu_linears.Fp32Linear)]
    for kernel in set(flags) & set(cpu_linears.FEW_ROW_KERNELS):  # one forced, for the A/B
        for m in fp32:
            m.few_row_kernels = (kernel,) * cpu_linears.FEW_ROWS
    if "hf" in flags:
        runner.body = None  # HF's own forward, for the A/B
    if "hflayout" in flags:
        runner.backend.paged_attention.__self__.group_alone = False  # for the A/B
    if "gather" in flags:
        runner.backend.paged_attention.__self__.decode_kernel = None  # for the A/B
    forward_s: list[float] = []
    forward = runner.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        forward_s.append(time.perf_counter() - start)
        return out

    runner.forward = timed_forward
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    steps: list[float] = []
    for repeat in range(2):  # the first round warms up; the second is measured
        forward_s.clear()
        steps.clear()
        for s in range(streams):
            base = 1000 + 97 * s + 13 * repeat
            llm.engine.add_request(list(range(base, base + PROMPT_TOKENS)), params)
        while llm.engine.has_unfinished:
            start = time.perf_counter()
            llm.engine.step()
            steps.append(time.perf_counter() - start)
    step, fwd = steps[1:], forward_s[1:]  # the prefill step is not a decode step
    rest = [a - b for a, b in zip(step, fwd)]
    return {
        "mode": mode,
        "streams": streams,
        "threads": torch.get_num_threads(),
        "step_ms": 1e3 * statistics.median(step),
        "forward_ms": 1e3 * statistics.median(fwd),
        "rest_ms": 1e3 * statistics.median(rest),
        "tok_s": streams / statistics.median(step),
        "few_row_kernels": "/".join(fp32[0].few_row_kernels) if fp32 else "-",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.cpu.bench_step", description=__doc__)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES))
    p.add_argument("--streams", nargs="+", type=int, default=[1, 8])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the modes this many times, interleaved, and report each mode's median round"
        " (a noisy machine moves one run by tens of percent)",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one "mode:streams"
    args = p.parse_args(argv)
    if args.one:
        mode, streams = args.one.rsplit(":", 1)
        print(json.dumps(measure(mode, int(streams), args.threads)))
        return 0
    print(f"load average at start: {os.getloadavg()}")
    print(
        "| mode | streams | threads | step ms | forward ms | rest ms | tok/s | rounds' step ms"
        " | fp32 kernels at 1/2/3 rows, each round |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for streams in args.streams:
        runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
        for _ in range(args.rounds):
            for mode in args.modes:
                cmd = [sys.executable, "-m", "perf.cpu.bench_step", "--one", f"{mode}:{streams}"]
                if args.threads is not None:
                    cmd += ["--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
        for rounds in runs.values():
            r = sorted(rounds, key=lambda x: x["step_ms"])[(len(rounds) - 1) // 2]
            spread = ", ".join(f"{x['step_ms']:.1f}" for x in rounds)
            kernels = ", ".join(x["few_row_kernels"] for x in rounds)
            print(
                f"| {r['mode']} | {r['streams']} | {r['threads']} | {r['step_ms']:.1f} | "
                f"{r['forward_ms']:.1f} | {r['rest_ms']:.2f} | {r['tok_s']:.1f} | {spread} | "
                f"{kernels} |",
                flush=True,
            )
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
