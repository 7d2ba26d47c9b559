"""``paged-generate``: one prompt through the paged engine, the completion on stdout."""

from __future__ import annotations

import argparse
import logging
import sys

from paged_serve.engine.engine_args import add_engine_args, engine_kwargs
from paged_serve.engine.executor.workers import TensorParallelError
from paged_serve.engine.llm import LLM
from paged_serve.engine.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged-generate", description=__doc__)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    parser.add_argument("--show-stats", action="store_true")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    llm: LLM | None = None
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(args.model, **engine_kwargs(args))
        prompt: str | list[int] = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompt = llm.tokenizer(prompt, add_special_tokens=False).input_ids
        result = llm.generate([prompt], params)[0]
    except (ValueError, TensorParallelError) as exc:
        print(f"paged-generate: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.shutdown()  # the tensor-parallel workers, if any
    print(result.text)
    if args.show_stats:
        m = result.metrics
        decode_time = m.tpot * max(m.num_output_tokens - 1, 0)
        rate = m.num_output_tokens / m.e2e_latency if m.e2e_latency > 0 else 0.0
        blocks = llm.engine.block_manager.blocks_for(m.num_prompt_tokens + m.num_output_tokens)
        print(
            f"prompt tokens: {m.num_prompt_tokens}\n"
            f"generated tokens: {m.num_output_tokens}\n"
            f"TTFT: {m.ttft * 1000:.1f} ms\n"
            f"TPOT: {m.tpot * 1000:.1f} ms\n"
            f"decode time: {decode_time:.3f} s\n"
            f"tokens/s: {rate:.1f}\n"
            f"KV blocks used: {blocks} of {llm.engine.block_manager.num_blocks} "
            f"(block size {llm.engine.block_manager.block_size})\n"
            f"finish reason: {result.finish_reason}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
