"""KV memory use of the paged block manager against a contiguous fixed-slot cache.

Allocates each request's tokens with the real
``paged_serve.engine.sched.block_manager.BlockManager`` and reports
its usage metrics next to the baseline a non-paged server would have: every request reserves a
contiguous slot as long as the longest request, so a short request wastes the rest of its slot.

    python -m perf.engine.bench_block_manager --block-size 16 --total-blocks 64 \
        --request-tokens 9,17,33,5,41,12

prints one JSON object. Token counts are KV slots (one slot holds one token's K and V).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from paged_serve.engine.sched.block_manager import BlockManager, OutOfBlocksError

DEFAULT_REQUEST_TOKENS = (9, 17, 33, 5, 41, 12)


def measure(block_size: int, total_blocks: int, request_tokens: Sequence[int]) -> dict[str, Any]:
    """Allocate every request in a fresh pool; return the report as a JSON-ready dict."""
    if not request_tokens or any(n < 1 for n in request_tokens):
        raise ValueError(
            f"request tokens must be a non-empty list of positive counts: {request_tokens}"
        )
    manager = BlockManager(total_blocks, block_size)
    for i, num_tokens in enumerate(request_tokens):
        manager.allocate(f"req-{i}", num_tokens)
    manager.check_integrity()
    usage = manager.usage()

    # Contiguous fixed slots: every request reserves room for the longest one.
    allocated = sum(request_tokens)
    slot_reserved = len(request_tokens) * max(request_tokens)
    slot_fragmentation = slot_reserved - allocated
    return {
        "block_size": block_size,
        "total_blocks": total_blocks,
        "request_tokens": list(request_tokens),
        "block_usage": {
            "allocated_tokens": usage.allocated_tokens,
            "reserved_tokens": usage.reserved_tokens,
            "internal_fragmentation_tokens": usage.internal_fragmentation_tokens,
            "block_utilization": usage.block_utilization,
            "used_blocks": usage.used_blocks,
            "free_blocks": usage.free_blocks,
        },
        "contiguous_fixed_slot_baseline": {
            "reserved_tokens": slot_reserved,
            "internal_fragmentation_tokens": slot_fragmentation,
            "utilization": round(allocated / slot_reserved, 4),
        },
        "fragmentation_tokens_saved_vs_contiguous": (
            slot_fragmentation - usage.internal_fragmentation_tokens
        ),
    }


def _token_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, print the report as JSON and return it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--total-blocks", type=int, default=64, help="blocks in the pool")
    parser.add_argument(
        "--request-tokens",
        type=_token_list,
        default=list(DEFAULT_REQUEST_TOKENS),
        help="comma-separated token counts, one per request",
    )
    args = parser.parse_args(argv)
    try:
        report = measure(args.block_size, args.total_blocks, args.request_tokens)
    except (ValueError, OutOfBlocksError) as exc:
        parser.error(str(exc))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
