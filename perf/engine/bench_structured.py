"""What structured outputs cost: decode-step time with every row constrained against none, the
host's mask filling alone, and grammar compile times (first, and a cache hit).

    python -m perf.engine.bench_structured [--batch-sizes 1,16,64] [--steps 12] [--dtype float32]

One run of the default model (CPU unless CUDA is there). For each batch size ``B``, ``B``
requests of the same prompt decode ``--steps`` tokens: once free (``ignore_eos``) and once under
a JSON schema whose one string property needs at least 200 characters, so no row finishes
early. The figure is the mean wall time of the decode steps (prefill excluded), constrained
over free, measured in the same process one after the other. Mask filling is also timed on its
own (``fill_token_bitmask`` over the same rows). Compile times use a fresh compiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.grammar.structured_output import GrammarCompiler, StructuredOutput
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sample.token_mask import fill_token_bitmask

PROMPT = "Write a long sentence about the sea, as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 200}},
    "required": ["text"],
}
# A schema of a typical app's size, for compile times.
COMPILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street"],
        },
    },
    "required": ["name", "age"],
}


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, params: SamplingParams) -> float:
    """Mean ms of ``steps`` decode steps of ``batch`` requests (after their prefill)."""
    for i in range(batch):
        engine.add_request(PROMPT, params, f"r{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort(f"r{i}")
    return statistics.mean(times) * 1000


def mask_fill_ms(engine: LLMEngine, batch: int, params: SamplingParams, repeats: int = 20) -> float:
    """Mean ms to fill the step's bitmask for ``batch`` constrained rows, host only."""
    for i in range(batch):
        engine.add_request(PROMPT, params, f"m{i}")
    engine.step()  # admit and prefill, so the rows are running and decoding
    batch_rows = list(engine.scheduler.running)
    start = time.perf_counter()
    for _ in range(repeats):
        fill_token_bitmask(batch_rows, engine.vocab_size)
    elapsed = (time.perf_counter() - start) / repeats * 1000
    for i in range(batch):
        engine.abort(f"m{i}")
    return elapsed


def compile_times(engine: LLMEngine) -> tuple[float, float]:
    """(first compile incl. indexing the vocabulary, cache hit), in ms, on a fresh compiler."""
    compiler = GrammarCompiler(
        engine.tokenizer, vocab_size=engine.vocab_size, stop_token_ids=sorted(engine.eos_token_ids)
    )
    constraint = StructuredOutput.json_schema(COMPILE_SCHEMA)
    start = time.perf_counter()
    compiler.compile(constraint)
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(constraint)
    return first * 1000, (time.perf_counter() - start) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = LLMEngine(
        EngineConfig(dtype=args.dtype, max_num_seqs=max(sizes), enable_prefix_caching=False)
    )
    first, hit = compile_times(engine)
    print(f"compile (a 5-property schema): first {first:.1f} ms (vocabulary indexed), "
          f"cache hit {hit:.3f} ms")  # fmt: skip
    constraint = StructuredOutput.json_schema(SCHEMA)
    free = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    bound = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, structured_output=constraint)
    decode_step_ms(engine, 1, 2, free)  # warm-up
    rows = []
    for batch in sizes:
        free_ms = decode_step_ms(engine, batch, args.steps, free)
        bound_ms = decode_step_ms(engine, batch, args.steps, bound)
        fill_ms = mask_fill_ms(engine, batch, bound)
        rows.append((batch, free_ms, bound_ms, fill_ms))
    print("B   free step ms   constrained step ms   extra   mask fill ms")
    for batch, free_ms, bound_ms, fill_ms in rows:
        extra = (bound_ms / free_ms - 1) * 100
        print(f"{batch:<3} {free_ms:>13.1f} {bound_ms:>21.1f} {extra:>6.1f}% {fill_ms:>14.2f}")
    dtype = str(engine.runner.kv_cache.tensor.dtype)
    summary = {"device": str(engine.device), "dtype": dtype, "rows": rows}
    print(json.dumps({**summary, "compile_first_ms": first, "compile_hit_ms": hit}))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
