"""How often batched greedy decoding agrees with Hugging Face alone, read two ways.

    python -m perf.engine.bench_agreement [--dtype bfloat16] [--quantization int4]
        [--workload decode-heavy] [--num-requests 24] [--hf-batch 24 --hf-batch 8]
        [--no-cpu-decode-kernel]

The reference is HF ``generate`` on each request alone (greedy, EOS ignored), as in the serving
check. Batching changes rounding (torch's CPU kernels round a row differently with other rows
beside it), so a batched system can pick another token where two logits nearly tie. The two
readings:

* **free-running**: each system generates its own tokens; the share of reference tokens before
  the first difference (``perf.engine.e2e_workload.agreement``). One near-tie flip counts every
  later token as a disagreement, since a greedy sequence that differs once continues differently.
  Reported for paged-serve (every request in one ``LLM.generate``) and for HF's own padded
  static batches of ``--hf-batch`` requests, which shows what batching alone does to HF.
* **teacher-forced**: paged-serve runs the same batch, but every step is fed the reference's
  token (``forced_agreement``), so each position is decided from HF's own prefix. The share of
  positions where the engine's own greedy pick equals the reference counts each rounding flip
  once, without the cascade.

Agreement is not timed: this is about tokens, not speed. It prints a markdown table and writes
JSON to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from paged_serve.engine.llm import LLM
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sample.sampling_rows import sampling_rows
from paged_serve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ForcedAgreement:
    """Teacher-forced agreement: ``positions`` decided, ``agreed`` of them equal to the reference,
    ``flips`` the (request index, position) pairs where they were not."""

    positions: int = 0
    agreed: int = 0
    flips: list[tuple[int, int]] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        return round(self.agreed / self.positions, 4) if self.positions else None


def forced_agreement(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]]
) -> tuple[ForcedAgreement, list[list[int]]]:
    """Run every prompt through ``engine`` together, greedy, each for ``len(reference)`` tokens,
    and feed the reference token at every step in place of the sampled one.

    Returns the agreement of the engine's own picks with the references, and the tokens each
    request ended with (the references, when the forcing worked). The engine's runner is
    wrapped for the call and restored after.
    """
    runner = engine.runner
    launch, draw = runner.launch, runner.sampler.draw
    index: dict[str, int] = {}
    rows: list[Any] = []
    result = ForcedAgreement()

    def launch_noting_rows(batch: Any, block_tables: Any) -> Any:
        rows[:] = sampling_rows(batch)
        return launch(batch, block_tables)

    def sample_then_force(logits: torch.Tensor, batch: Any, mask: Any) -> Any:
        tokens, logprobs = draw(logits, batch, mask)
        for i, row in enumerate(rows):
            request, position = index[row.request_id], len(row.output_token_ids)
            wanted = references[request][position]
            result.positions += 1
            if int(tokens[i]) == wanted:
                result.agreed += 1
            else:
                result.flips.append((request, position))
            tokens[i] = wanted
        return tokens, logprobs

    runner.launch, runner.sampler.draw = launch_noting_rows, sample_then_force
    try:
        for i, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
            params = SamplingParams(max_tokens=len(reference), temperature=0.0, ignore_eos=True)
            index[engine.add_request(list(prompt), params)] = i
        outputs: list[list[int]] = [[] for _ in prompts]
        while engine.has_unfinished:
            for out in engine.step():
                outputs[index[out.request_id]] += out.new_token_ids
    except BaseException:
        for request_id in index:
            engine.abort(request_id)
        raise
    finally:
        runner.launch, runner.sampler.draw = launch, draw
    return result, outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument(
        "--workload", default="decode-heavy", choices=["decode-heavy", "long-prompt"]
    )
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-batch",
        type=int,
        action="append",
        help="HF static batch sizes to compare (repeatable; default: all requests in one batch)",
    )
    parser.add_argument(
        "--no-cpu-decode-kernel",
        action="store_true",
        help="attend decode steps with torch's gather and SDPA, not the C kernel (an A/B)",
    )
    parser.add_argument("--out-dir", default="/tmp/bench_agreement")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from paged_serve.engine.model.loader import load_model
    from perf.engine.e2e_workload import agreement
    from perf.engine.hf_baselines import hf_generate_padded
    from perf.serving.bench_serving import source_revision
    from perf.serving.check import hf_references
    from perf.serving.workloads import decode_heavy, long_prompt

    args = parse_args(argv)
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")
    started = time.perf_counter()
    hf = load_model(None, dtype=dtype, device=cpu)
    mix = decode_heavy if args.workload == "decode-heavy" else long_prompt
    workload = mix(hf.tokenizer, num_requests=args.num_requests, seed=args.seed)
    everyone = range(workload.num_requests)
    references = hf_references(hf.model, workload, everyone)
    alone = [references[i] for i in everyone]
    pad = hf.tokenizer.pad_token_id if hf.tokenizer.pad_token_id is not None else 0
    free: dict[str, dict] = {}
    for size in args.hf_batch or [workload.num_requests]:
        tokens: list[list[int]] = []
        for start in range(0, workload.num_requests, size):
            prompts = workload.prompts[start : start + size]
            limits = workload.max_tokens[start : start + size]
            batch = hf_generate_padded(hf.model, prompts, max(limits), pad)
            tokens += [row[:limit] for row, limit in zip(batch, limits)]
        free[f"hf static, batches of {size}"] = agreement(alone, tokens)
    system = f"paged-serve {args.dtype}" + (f" {args.quantization}" if args.quantization else "")
    system += ", torch's decode attention" if args.no_cpu_decode_kernel else ""
    llm = LLM(
        loaded=load_model(None, dtype=dtype, device=cpu),
        quantization=args.quantization,
        cpu_decode_kernel=not args.no_cpu_decode_kernel,
    )
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens
    ]
    own = [out.token_ids for out in llm.generate(workload.prompts, params)]
    free[f"{system}, all batched"] = agreement(alone, own)
    forced, fed = forced_agreement(llm.engine, workload.prompts, alone)
    if fed != alone:
        raise RuntimeError("the forced run did not end with the reference tokens")
    report = {
        **source_revision(),
        "workload": workload.summary(),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "reference": f"HF generate alone on each request, {args.dtype}",
        "free_running": free,
        "teacher_forced": {system: {**asdict(forced), "rate": forced.rate}},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(_markdown(report))
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(
        args.out_dir, f"bench_agreement-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    )
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0


def _markdown(report: dict) -> str:
    lines = [
        f"perf.engine.bench_agreement, commit {report['commit']}, {report['workload']['name']}, "
        f"reference: {report['reference']}",
        "",
        "| reading | system | share of tokens | requests exact |",
        "|---|---|---|---|",
    ]
    for name, a in report["free_running"].items():
        lines.append(
            f"| free-running (prefix) | {name} | {a['token_match_rate']} | "
            f"{a['exact_requests']}/{a['requests']} |"
        )
    for name, f in report["teacher_forced"].items():
        flipped = len({request for request, _ in f["flips"]})
        lines.append(
            f"| teacher-forced (per position) | {name} | {f['rate']} ({f['agreed']}/"
            f"{f['positions']}) | {report['workload']['num_requests'] - flipped}/"
            f"{report['workload']['num_requests']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
